//! The queue's public copies, reads and writes take graft buffers and check them before
//! touching memory: this device's, still valid, long enough.

use graft_core::{Config, DeviceError, DeviceOp, Graft};
use graft_sim::{SimDevice, SimQueue};

fn invalid_argument(op: DeviceOp) -> impl Fn(&Result<(), DeviceError>) -> bool {
    move |r| matches!(r, Err(DeviceError::InvalidArgument { op: got, .. }) if *got == op)
}

#[test]
fn copy_read_write_check_their_buffers() {
    let dev = SimDevice::new();
    let mut g: Graft<SimDevice, ()> = Graft::new(dev.clone(), Config::default());
    let (a, b) = (g.alloc(16).unwrap(), g.alloc(8).unwrap());
    let q: &SimQueue = &dev;
    q.write(&a, &[7; 16]).unwrap();
    q.copy(&b, &a, 8).unwrap();
    let mut back = [0u8; 8];
    q.read(&b, &mut back).unwrap();
    assert_eq!(back, [7; 8]);

    // Past a buffer's end, on either side.
    assert!(invalid_argument(DeviceOp::Copy)(&q.copy(&b, &a, 16)));
    assert!(invalid_argument(DeviceOp::Write)(&q.write(&b, &[0; 9])));
    assert!(invalid_argument(DeviceOp::Read)(&q.read(&b, &mut [0; 9])));

    // A buffer of another device.
    let other = SimDevice::new();
    assert!(invalid_argument(DeviceOp::Copy)(&other.copy(&b, &a, 8)));

    // A buffer graft no longer backs.
    g.close().unwrap();
    assert!(matches!(
        q.read(&a, &mut back),
        Err(DeviceError::InvalidBuffer {
            op: DeviceOp::Read,
            ..
        })
    ));
}
