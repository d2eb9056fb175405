//! The `cuda` module of a build without the `cuda` feature (chosen in `lib.rs`): the same
//! items as the CUDA build's, with no CUDA behind them. The graph engine never opens, so every
//! [`CandleGraft`](crate::CandleGraft) runs eagerly; the CUDA figures refuse with
//! [`Error::NoCuda`]. Candle's `CudaDevice` is a stand-in there too, unless the application
//! enables candle's own `cuda` feature (Cargo unifies it): then candle runs on the GPU and
//! this crate warns, once, that its calls run eagerly until its `cuda` feature is on.

use std::ffi::c_void;

use candle_core::{CudaDevice, Device, Tensor};
use graft_core::{Config, FunctionId, FunctionSpec};

use crate::diagnostics::Inspect;
use crate::error::Error;
use crate::looping::Loops;
pub use crate::memory::{EagerMemory, GraphMemory};
use crate::step::{Call, Step, StepInfo};

/// The graph engine of this build: none (an enum with no values).
#[derive(Debug)]
pub(crate) enum GraphEngine {}

impl GraphEngine {
    /// No engine, on any device: calls run eagerly (with a warning on a CUDA device, which
    /// only a candle built with its own `cuda` feature has).
    pub(crate) fn open(device: &Device, _config: Config) -> Result<Option<GraphEngine>, Error> {
        if device.is_cuda() {
            warn_without_cuda();
        }
        Ok(None)
    }

    pub(crate) fn register(&mut self, _name: &str, _spec: FunctionSpec) -> FunctionId {
        match *self {}
    }

    pub(crate) fn call<F>(
        &mut self,
        _step: usize,
        _info: &StepInfo,
        _call: Call<'_>,
        _body: F,
    ) -> Result<Step, Error>
    where
        F: FnMut(&[Tensor], &mut Loops<'_>) -> candle_core::Result<Vec<Tensor>>,
    {
        match *self {}
    }

    pub(crate) fn join(&mut self, _member: graft_core::Member) {
        match *self {}
    }

    pub(crate) fn take_deferred_error(&self) {
        match *self {}
    }

    pub(crate) fn mark_step_begin(&mut self) {
        match *self {}
    }

    pub(crate) fn guard_next_call(&mut self) {
        match *self {}
    }

    pub(crate) fn inspect(&self) -> &dyn Inspect {
        match *self {}
    }
}

/// [`Device::Cpu`], whatever the ordinal (see [`crate::device`]); with a warning where candle
/// itself has CUDA.
pub(crate) fn device(_ordinal: usize) -> candle_core::Result<Device> {
    if candle_core::utils::cuda_is_available() {
        warn_without_cuda();
    }
    Ok(Device::Cpu)
}

/// Warns once that candle has CUDA but this crate was built without it.
fn warn_without_cuda() {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            "graft-candle was built without its `cuda` feature while candle has CUDA: `graft_candle::device` gives the CPU and every CandleGraft call runs eagerly; enable graft-candle's `cuda` feature"
        );
    });
}

/// A null stream: there is no CUDA stream in this build.
pub fn capture_stream(_device: &CudaDevice) -> *mut c_void {
    std::ptr::null_mut()
}

/// Refuses with [`Error::NoCuda`].
pub fn graph_memory(_device: &CudaDevice) -> Result<GraphMemory, Error> {
    Err(Error::NoCuda {
        what: "reading the graph memory figures",
    })
}

/// Refuses with [`Error::NoCuda`].
pub fn trim_graph_memory(_device: &CudaDevice) -> Result<(), Error> {
    Err(Error::NoCuda {
        what: "trimming graph memory",
    })
}

/// Refuses with [`Error::NoCuda`].
pub fn free_memory(_device: &CudaDevice) -> Result<(u64, u64), Error> {
    Err(Error::NoCuda {
        what: "reading the free device memory",
    })
}

/// Refuses with [`Error::NoCuda`].
pub fn eager_memory(_device: &CudaDevice) -> Result<EagerMemory, Error> {
    Err(Error::NoCuda {
        what: "reading the default memory pool's figures",
    })
}

/// Refuses with [`Error::NoCuda`].
pub fn reset_eager_high(_device: &CudaDevice) -> Result<(), Error> {
    Err(Error::NoCuda {
        what: "resetting the default memory pool's high-water mark",
    })
}

pub use crate::no_nccl::TpComm;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use graft_launch::{ProcessGroup, Rendezvous};

    use super::*;

    #[test]
    fn the_cuda_figures_refuse_and_say_how_to_build_with_cuda() {
        let device = CudaDevice;
        let e = graph_memory(&device).unwrap_err();
        assert!(matches!(e, Error::NoCuda { .. }), "{e}");
        assert!(e.to_string().contains("--features cuda"), "{e}");
        assert!(trim_graph_memory(&device).is_err());
        assert!(free_memory(&device).is_err());
        assert!(eager_memory(&device).is_err());
        assert!(reset_eager_high(&device).is_err());
        assert!(capture_stream(&device).is_null());
        let place = ProcessGroup::new(0, 1, 0, "127.0.0.1", 1).unwrap();
        let mut rv = Rendezvous::join(&place, Duration::from_secs(1)).unwrap();
        let e =
            TpComm::init_rank(&Device::Cpu, &place, &mut rv, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, Error::NoCuda { .. }), "{e}");
        assert!(
            GraphEngine::open(&Device::Cpu, Config::default())
                .unwrap()
                .is_none()
        );
    }
}
