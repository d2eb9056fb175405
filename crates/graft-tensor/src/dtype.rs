//! Element types of tensors ([`DType`]).

use std::fmt;

/// Element types.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 32-bit signed integer (token ids, positions).
    I32,
    /// 32-bit unsigned integer (random generator state, loop flags).
    U32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        4
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::U32 => "u32",
        })
    }
}
