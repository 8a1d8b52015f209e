//! Block I/O engines for the NVMe tier (`uring`, the only io_uring user), and the
//! completion hand-off from worker threads to the server thread (`completions`).

pub mod completions;
pub mod faults;
pub mod uring;
