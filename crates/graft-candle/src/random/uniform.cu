
__device__ unsigned long long graft_offset(const unsigned int* state) {
    return ((unsigned long long)state[3] << 32) | state[2];
}

extern "C" __global__ void graft_philox_uniform(
    const unsigned int* state, float* out, unsigned long long n) {
    unsigned long long block = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long first = block * 4;
    if (first >= n) {
        return;
    }
    unsigned long long counter = graft_offset(state) + block;
    unsigned int words[4] = {(unsigned int)counter, (unsigned int)(counter >> 32), 0u, 0u};
    graft_philox4x32_10(words, state[0], state[1]);
    for (int lane = 0; lane < 4 && first + lane < n; ++lane) {
        out[first + lane] = graft_philox_unit(words[lane]);
    }
}

extern "C" __global__ void graft_philox_advance(unsigned int* state, unsigned long long blocks) {
    unsigned long long offset = graft_offset(state) + blocks;
    state[2] = (unsigned int)offset;
    state[3] = (unsigned int)(offset >> 32);
}
