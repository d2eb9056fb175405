//! `CoreOnly`, the capability token that keeps the `Device` trait's dangerous methods to graft-core.

/// Proof that the caller is graft-core: the first argument of every [`Device`](super::Device)
/// method that changes capture, memory mapping, graphs or the sticky error slot, or touches
/// memory at raw addresses (see the trait's methods). Its field is private, so only graft-core
/// makes one; it is passed by reference and is neither `Clone` nor `Copy`, so an
/// implementation of the trait can use it while the call lasts but never keep it. Framework
/// code and bodies hold the device, or its queue, but no token, so they cannot call those
/// methods. Backends take it and ignore it.
///
/// A framework cannot make one:
///
/// ```compile_fail
/// let token = graft_core::backend::CoreOnly(());
/// ```
///
/// and without one it cannot reach a sealed method:
///
/// ```compile_fail
/// fn framework<D: graft_core::Device>(device: &D) {
///     let _ = device.begin_capture(graft_core::CaptureMode::ThreadLocal);
/// }
/// ```
///
/// Graft's own backend tests and benchmarks drive devices directly: they get a token from
/// `CoreOnly::for_tests_and_benches`, which exists only with graft-core's `test-support`
/// feature.
#[derive(Debug)]
pub struct CoreOnly(());

/// The token graft-core passes to its devices.
pub(crate) const CORE: &CoreOnly = &CoreOnly(());

impl CoreOnly {
    /// A token for graft's own tests and benchmarks that drive a device directly: the
    /// backends' tests, and the raw-graph baselines graft's benchmarks compare against. Only
    /// with graft-core's `test-support` feature, which no framework should enable.
    #[cfg(feature = "test-support")]
    pub const fn for_tests_and_benches() -> CoreOnly {
        CoreOnly(())
    }
}
