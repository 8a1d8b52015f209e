//! Block I/O engines for the NVMe tier. `uring` is the only io_uring user.

pub mod uring;
