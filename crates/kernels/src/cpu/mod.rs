//! CPU kernels
