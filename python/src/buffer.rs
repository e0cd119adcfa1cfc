//! [`HostBuffer`]: a flat `float32` buffer of the node's that Python reads and writes in place.
//!
//! Parameters cross between the node and a PyTorch model without serialization: the node lends
//! a buffer, the model's side views it with `torch.frombuffer(buffer, dtype=torch.float32)`
//! (the buffer protocol) and copies its tensors into it, or adds from it. That is the one copy
//! each way. A buffer that a tensor still views cannot be taken back.

use std::ffi::{CString, c_int, c_void};

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

/// A flat `float32` buffer, lent by the node to the training process.
#[pyclass(module = "murmur._native")]
#[derive(Debug)]
pub(crate) struct HostBuffer {
    values: Vec<f32>,
    /// Views handed out and not released.
    exports: usize,
    /// The buffer's shape and strides, as the buffer protocol points at them.
    shape: [ffi::Py_ssize_t; 1],
    strides: [ffi::Py_ssize_t; 1],
}

impl HostBuffer {
    pub(crate) fn new(values: Vec<f32>) -> Self {
        let len = ffi::Py_ssize_t::try_from(values.len()).unwrap_or(ffi::Py_ssize_t::MAX);
        HostBuffer {
            values,
            exports: 0,
            shape: [len],
            strides: [4],
        }
    }

    /// The values, once no view is left.
    pub(crate) fn take(&mut self) -> PyResult<Vec<f32>> {
        if self.exports > 0 {
            return Err(PyBufferError::new_err(
                "a tensor still views the node's buffer: drop it (`del`) before returning",
            ));
        }
        self.shape = [0];
        Ok(std::mem::take(&mut self.values))
    }
}

#[pymethods]
impl HostBuffer {
    /// Values in the buffer.
    fn __len__(&self) -> usize {
        self.values.len()
    }

    // The buffer protocol is C's: the view points into `values`, which stays where it is
    // while views are out (`take` refuses until every one is released).
    #[allow(unsafe_code)]
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("the view is null"));
        }
        let mut this = slf.borrow_mut();
        this.exports += 1;
        let format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
            CString::new("f")
                .map_err(|e| PyBufferError::new_err(e.to_string()))?
                .into_raw()
        } else {
            std::ptr::null_mut()
        };
        let len = ffi::Py_ssize_t::try_from(this.values.len() * 4)
            .map_err(|_| PyBufferError::new_err("the buffer is too large"))?;
        let buf = this.values.as_mut_ptr().cast::<c_void>();
        let shape = this.shape.as_mut_ptr();
        let strides = this.strides.as_mut_ptr();
        drop(this);
        // SAFETY: `view` is a valid `Py_buffer` that Python asked this object to fill; the
        // pointers stay valid while the object lives and the view is out (see above).
        unsafe {
            (*view).obj = slf.into_any().into_ptr();
            (*view).buf = buf;
            (*view).len = len;
            (*view).readonly = 0;
            (*view).itemsize = 4;
            (*view).format = format;
            (*view).ndim = 1;
            (*view).shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
                shape
            } else {
                std::ptr::null_mut()
            };
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                strides
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
        }
        Ok(())
    }

    #[allow(unsafe_code)]
    unsafe fn __releasebuffer__(&mut self, view: *mut ffi::Py_buffer) {
        self.exports = self.exports.saturating_sub(1);
        // SAFETY: `format` was made by `CString::into_raw` in `__getbuffer__`, or is null.
        unsafe {
            if !(*view).format.is_null() {
                drop(CString::from_raw((*view).format));
            }
        }
    }
}
