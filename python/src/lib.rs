//! # kvd-python
//!
//! The `kvd` Python package's native module (`kvd._native`): [`kvd_client::Client`]
//! wrapped with PyO3 — not a second client. Every call that waits for the daemon
//! releases the GIL (`Python::detach`); daemon errors are `kvd.KvdError` with the wire
//! `code` (SPEC §5) and `message`; the pool is exposed zero-copy through the buffer
//! protocol ([`Pool`]: `memoryview(client.pool())`, `numpy.frombuffer`,
//! `torch.frombuffer`). Keys are 16-byte `bytes`; layouts are dicts with the SPEC §3.1
//! field names; replies are plain dicts and lists.
//!
//! This module owns the Python boundary; its one `unsafe` block fills a `Py_buffer`
//! for the pool mapping.

use std::ffi::c_int;
use std::sync::Mutex;
use std::time::Duration;

use kvd_client::{Client as RsClient, MapPool, PinnedBlocks, PoolRegion, WriteBatch};
use kvd_protocol::{
    AllocStatus, ChunkHash, GpuRegion, GpuSegment, GpuTransferParams, Layout, LayoutId, PinId,
    TransferParams,
};
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict, PyList};

pyo3::create_exception!(
    _native,
    KvdError,
    PyException,
    "A daemon error: `code` is the wire code (e.g. 'pool_full'), `message` says why."
);

/// A client error as `KvdError` (daemon errors carry their wire code; others `code`
/// is `None`).
fn err(e: kvd_client::Error) -> PyErr {
    let code = e.code().map(|c| c.as_str());
    let msg = e.to_string();
    Python::attach(|py| {
        let pe = KvdError::new_err(msg.clone());
        let v = pe.value(py);
        let _ = v.setattr("code", code);
        let _ = v.setattr("message", msg);
        pe
    })
}

fn keys_of(keys: Vec<Vec<u8>>) -> PyResult<Vec<ChunkHash>> {
    keys.into_iter()
        .enumerate()
        .map(|(i, k)| {
            <[u8; 16]>::try_from(k.as_slice())
                .map(ChunkHash)
                .map_err(|_| {
                    PyValueError::new_err(format!("keys[{i}] is {} bytes, not 16", k.len()))
                })
        })
        .collect()
}

/// A serde value as Python objects (through JSON: replies hold no bytes).
fn to_py<'py, T: serde::Serialize>(py: Python<'py>, v: &T) -> PyResult<Bound<'py, PyAny>> {
    let s = serde_json::to_string(v).map_err(|e| PyValueError::new_err(e.to_string()))?;
    py.import("json")?.call_method1("loads", (s,))
}

/// A layout dict (SPEC §3.1 field names) as a [`Layout`] (through JSON, as `to_py`).
fn layout_of(py: Python<'_>, layout: &Bound<'_, PyDict>) -> PyResult<Layout> {
    let s: String = py
        .import("json")?
        .call_method1("dumps", (layout,))?
        .extract()?;
    serde_json::from_str(&s).map_err(|e| PyValueError::new_err(format!("layout: {e}")))
}

fn secs(s: Option<f64>) -> PyResult<Option<Duration>> {
    s.map(|x| Duration::try_from_secs_f64(x).map_err(|e| PyValueError::new_err(e.to_string())))
        .transpose()
}

fn status_str(s: &AllocStatus) -> &'static str {
    match s {
        AllocStatus::New => "new",
        AllocStatus::Exists => "exists",
        AllocStatus::Busy => "busy",
    }
}

/// A session with the node's daemon.
#[pyclass(module = "kvd._native")]
struct Client {
    inner: RsClient,
}

impl Client {
    /// `lookup`, or with `probe` set the same without the NVMe prefetch (and, with
    /// `Some(true)`, asking no peer).
    fn ask<'py>(
        &self,
        py: Python<'py>,
        layout_id: u64,
        keys: Vec<Vec<u8>>,
        probe: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let keys = keys_of(keys)?;
        let l = LayoutId(layout_id);
        let r = py
            .detach(|| match probe {
                None => self.inner.lookup(l, &keys),
                Some(false) => self.inner.probe(l, &keys),
                Some(true) => self.inner.probe_local(l, &keys),
            })
            .map_err(err)?;
        to_py(py, &r)
    }
}

#[pymethods]
impl Client {
    /// Connects (says `hello`, maps the pool when `map_pool`). `endpoint` defaults to the
    /// daemon's default ipc socket. `token` and `tenant`: on a daemon with tenants (SPEC
    /// §18), the credential the session presents and which of its tenants it acts for
    /// (default `$KVD_TENANT_TOKEN`, `$KVD_TENANT`).
    #[new]
    #[pyo3(signature = (endpoint=None, name="kvd-python", timeout_s=10.0, map_pool=true, token=None, tenant=None))]
    fn new(
        py: Python<'_>,
        endpoint: Option<String>,
        name: &str,
        timeout_s: f64,
        map_pool: bool,
        token: Option<String>,
        tenant: Option<String>,
    ) -> PyResult<Self> {
        let timeout = secs(Some(timeout_s))?.unwrap_or_default();
        let mut b = RsClient::builder()
            .with_name(name)
            .with_timeout(timeout)
            .with_map_pool(if map_pool {
                MapPool::Always
            } else {
                MapPool::Never
            });
        if let Some(e) = endpoint {
            b = b.with_endpoint(e);
        }
        if let Some(t) = token {
            b = b.with_token(t);
        }
        if let Some(t) = tenant {
            b = b.with_tenant(t);
        }
        let inner = py.detach(|| b.connect()).map_err(err)?;
        Ok(Client { inner })
    }

    /// The daemon's incarnation (new at every daemon start).
    #[getter]
    fn incarnation(&self) -> u64 {
        self.inner.incarnation().0
    }

    /// The `hello` reply (pool, limits, node).
    fn hello_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_py(py, &self.inner.hello_info())
    }

    /// Registers a layout (a dict with SPEC §3.1's fields); returns
    /// `{"layout_id", "block_bytes", "slot_bytes"}`.
    fn register_layout<'py>(
        &self,
        py: Python<'py>,
        layout: &Bound<'py, PyDict>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let l = layout_of(py, layout)?;
        let info = py.detach(|| self.inner.register_layout(&l)).map_err(err)?;
        let d = PyDict::new(py);
        d.set_item("layout_id", info.id.0)?;
        d.set_item("block_bytes", info.block_bytes)?;
        d.set_item("slot_bytes", info.slot_bytes)?;
        Ok(d)
    }

    /// The number of leading keys cached (no side effects beyond LRU touches and an
    /// NVMe prefetch), and the tier of each.
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        layout_id: u64,
        keys: Vec<Vec<u8>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.ask(py, layout_id, keys, None)
    }

    /// `lookup` without the NVMe prefetch: only says where the prefix is (a monitor);
    /// with `local_only`, of this node's own tiers, asking no peer (a router comparing
    /// nodes).
    #[pyo3(signature = (layout_id, keys, local_only = false))]
    fn probe<'py>(
        &self,
        py: Python<'py>,
        layout_id: u64,
        keys: Vec<Vec<u8>>,
        local_only: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.ask(py, layout_id, keys, Some(local_only))
    }

    /// Reserves slots (write them through `pool()` at `WriteBatch.offsets`, then
    /// `commit()`).
    fn alloc(&self, py: Python<'_>, layout_id: u64, keys: Vec<Vec<u8>>) -> PyResult<Batch> {
        let keys = keys_of(keys)?;
        let b = py
            .detach(|| self.inner.alloc(LayoutId(layout_id), &keys))
            .map_err(err)?;
        Ok(Batch {
            inner: Mutex::new(Some(b)),
        })
    }

    /// Stores blocks (each exactly the layout's block size; `bytes` or `bytearray`):
    /// copies them into slots and commits. Returns per key "new" (stored), "exists" or
    /// "busy".
    fn store(
        &self,
        py: Python<'_>,
        layout_id: u64,
        keys: Vec<Vec<u8>>,
        blocks: Vec<PyBackedBytes>,
    ) -> PyResult<Vec<&'static str>> {
        let keys = keys_of(keys)?;
        let out = py
            .detach(|| {
                // Borrowed from the Python objects (bytes are not copied here): the one
                // copy is kvd-client's, into the slots.
                let refs: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
                self.inner.store(LayoutId(layout_id), &keys, &refs)
            })
            .map_err(err)?;
        Ok(out.status.iter().map(status_str).collect())
    }

    /// Pins the cached keys; read them through `pool()` at `Pinned.offsets`, then
    /// `release()` (before `ttl_s`).
    #[pyo3(signature = (layout_id, keys, ttl_s=None))]
    fn get(
        &self,
        py: Python<'_>,
        layout_id: u64,
        keys: Vec<Vec<u8>>,
        ttl_s: Option<f64>,
    ) -> PyResult<Pinned> {
        let keys = keys_of(keys)?;
        let ttl = secs(ttl_s)?;
        let p = py
            .detach(|| self.inner.get(LayoutId(layout_id), &keys, ttl))
            .map_err(err)?;
        Ok(Pinned {
            inner: Mutex::new(Some(p)),
        })
    }

    /// Releases a pin by id (`Pinned.release()` is the usual way).
    fn release(&self, py: Python<'_>, pin: u64) -> PyResult<()> {
        py.detach(|| self.inner.release(PinId(pin))).map_err(err)
    }

    /// Deletes blocks; per key "deleted", "missing", "pinned" or "busy".
    fn delete<'py>(
        &self,
        py: Python<'py>,
        layout_id: u64,
        keys: Vec<Vec<u8>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let keys = keys_of(keys)?;
        let r = py
            .detach(|| self.inner.delete(LayoutId(layout_id), &keys))
            .map_err(err)?;
        to_py(py, &r)
    }

    /// `verify` (SPEC §4): the daemon checks the blocks against their writer checksums
    /// and drops those that fail; per key "intact", "damaged", "unchecked" or "missing".
    /// What a reader whose own check (`Pinned.verify`) failed sends.
    fn verify<'py>(
        &self,
        py: Python<'py>,
        layout_id: u64,
        keys: Vec<Vec<u8>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let keys = keys_of(keys)?;
        let r = py
            .detach(|| self.inner.verify(LayoutId(layout_id), &keys))
            .map_err(err)?;
        to_py(py, &r)
    }

    /// The daemon's counters (SPEC §4 `stats`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let r = py.detach(|| self.inner.stats()).map_err(err)?;
        to_py(py, &r)
    }

    /// Prefill side: pins committed blocks under a lease; returns the
    /// `kv_transfer_params` as msgpack bytes (what a router forwards).
    #[pyo3(signature = (transfer_id, layout_id, keys, lease_s=None))]
    fn export<'py>(
        &self,
        py: Python<'py>,
        transfer_id: &str,
        layout_id: u64,
        keys: Vec<Vec<u8>>,
        lease_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let keys = keys_of(keys)?;
        let lease = secs(lease_s)?;
        let p = py
            .detach(|| {
                self.inner
                    .export(transfer_id, LayoutId(layout_id), &keys, lease)
            })
            .map_err(err)?;
        Ok(PyBytes::new(py, &p.to_msgpack()))
    }

    /// Decode side: admits a transfer at scheduling time (its lease heartbeats from now).
    #[pyo3(signature = (params, ttl_s=None))]
    fn admit<'py>(
        &self,
        py: Python<'py>,
        params: &[u8],
        ttl_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let p =
            TransferParams::from_msgpack(params).map_err(|e| PyValueError::new_err(e.message))?;
        let ttl = secs(ttl_s)?;
        let r = py.detach(|| self.inner.admit(&p, ttl)).map_err(err)?;
        to_py(py, &r)
    }

    /// Decode side: pulls an export into this node's pool (`wait`: until it ends).
    #[pyo3(signature = (params, ttl_s=None, wait=true))]
    fn pull<'py>(
        &self,
        py: Python<'py>,
        params: &[u8],
        ttl_s: Option<f64>,
        wait: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let p =
            TransferParams::from_msgpack(params).map_err(|e| PyValueError::new_err(e.message))?;
        let ttl = secs(ttl_s)?;
        let r = py.detach(|| self.inner.pull(&p, ttl, wait)).map_err(err)?;
        to_py(py, &r)
    }

    /// Decode side: pre-allocates slots the prefill node (`node`, its control endpoint)
    /// writes into once it exports `transfer_id`.
    #[pyo3(signature = (transfer_id, layout_id, keys, node, ttl_s=None))]
    fn push_register<'py>(
        &self,
        py: Python<'py>,
        transfer_id: &str,
        layout_id: u64,
        keys: Vec<Vec<u8>>,
        node: &str,
        ttl_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let keys = keys_of(keys)?;
        let ttl = secs(ttl_s)?;
        let r = py
            .detach(|| {
                self.inner
                    .push_register(transfer_id, LayoutId(layout_id), &keys, node, ttl)
            })
            .map_err(err)?;
        to_py(py, &r)
    }

    /// A transfer's state (waits up to `wait_s` for it to end).
    #[pyo3(signature = (transfer_id, wait_s=0.0))]
    fn transfer_status<'py>(
        &self,
        py: Python<'py>,
        transfer_id: &str,
        wait_s: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let wait = secs(Some(wait_s))?.unwrap_or_default();
        let r = py
            .detach(|| self.inner.transfer_status(transfer_id, wait))
            .map_err(err)?;
        to_py(py, &r)
    }

    /// Aborts a transfer this session owns.
    fn abort<'py>(&self, py: Python<'py>, transfer_id: &str) -> PyResult<Bound<'py, PyAny>> {
        let r = py
            .detach(|| self.inner.abort_transfer(transfer_id))
            .map_err(err)?;
        to_py(py, &r)
    }

    /// Declines a handoff this engine will not take (`params`: the export's
    /// `kv_transfer_params` as bytes): the exporter frees its blocks now instead of at
    /// the end of the lease. Returns whether the exporter was told.
    #[pyo3(signature = (params, reason=""))]
    fn decline(&self, py: Python<'_>, params: &[u8], reason: &str) -> PyResult<bool> {
        let p =
            TransferParams::from_msgpack(params).map_err(|e| PyValueError::new_err(e.message))?;
        py.detach(|| self.inner.decline(&p, reason)).map_err(err)
    }

    // ----- the GPU tier (SPEC §13) -----

    /// Registers engine memory: `regions` is a list of `(handle: bytes, size: int)` (a
    /// CUDA IPC handle, or a file name in the daemon's `gpu.host_dir` for the host
    /// stand-in), `segments` a list of `(region, offset, stride, len)`. Returns
    /// `{"registration", "device", "idle_ttl_ms"}`.
    #[pyo3(signature = (layout_id, regions, num_blocks, segments, device=0))]
    fn gpu_register<'py>(
        &self,
        py: Python<'py>,
        layout_id: u64,
        regions: Vec<(Vec<u8>, u64)>,
        num_blocks: u64,
        segments: Vec<(u32, u64, u64, u64)>,
        device: u32,
    ) -> PyResult<Bound<'py, PyAny>> {
        let regions: Vec<GpuRegion> = regions
            .into_iter()
            .map(|(handle, size)| GpuRegion { handle, size })
            .collect();
        let segments: Vec<GpuSegment> = segments
            .into_iter()
            .map(|(region, offset, stride, len)| GpuSegment {
                region,
                offset,
                stride,
                len,
            })
            .collect();
        let r = py
            .detach(|| {
                self.inner.gpu_register(
                    LayoutId(layout_id),
                    device,
                    &regions,
                    num_blocks,
                    &segments,
                )
            })
            .map_err(err)?;
        to_py(py, &r)
    }

    /// Ends a registration; returns the copies still in flight.
    fn gpu_unregister(&self, py: Python<'_>, registration: u64) -> PyResult<u64> {
        py.detach(|| self.inner.gpu_unregister(registration))
            .map(|r| r.in_flight)
            .map_err(err)
    }

    /// This session's registrations (also a keep-alive).
    fn gpu_list<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let r = py.detach(|| self.inner.gpu_list()).map_err(err)?;
        to_py(py, &r)
    }

    /// Copies `blocks` of a registration into the cache under `keys`; per key "stored",
    /// "exists" or "busy".
    fn gpu_store<'py>(
        &self,
        py: Python<'py>,
        registration: u64,
        keys: Vec<Vec<u8>>,
        blocks: Vec<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let keys = keys_of(keys)?;
        let r = py
            .detach(|| self.inner.gpu_store(registration, &keys, &blocks))
            .map_err(err)?;
        to_py(py, &r.status)
    }

    /// Copies the longest cached prefix of `keys` into `blocks`; returns how many.
    fn gpu_load(
        &self,
        py: Python<'_>,
        registration: u64,
        keys: Vec<Vec<u8>>,
        blocks: Vec<u64>,
    ) -> PyResult<u64> {
        let keys = keys_of(keys)?;
        py.detach(|| self.inner.gpu_load(registration, &keys, &blocks))
            .map_err(err)
    }

    /// Offers blocks to a `gpu_pull` by another engine on this node; returns the params
    /// as msgpack bytes.
    #[pyo3(signature = (registration, transfer_id, keys, blocks, lease_s=None))]
    fn gpu_export<'py>(
        &self,
        py: Python<'py>,
        registration: u64,
        transfer_id: &str,
        keys: Vec<Vec<u8>>,
        blocks: Vec<u64>,
        lease_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let keys = keys_of(keys)?;
        let lease = secs(lease_s)?;
        let p = py
            .detach(|| {
                self.inner
                    .gpu_export(registration, transfer_id, &keys, &blocks, lease)
            })
            .map_err(err)?;
        Ok(PyBytes::new(py, &p.to_msgpack()))
    }

    /// Copies an export's blocks into `blocks` of this session's registration.
    fn gpu_pull(
        &self,
        py: Python<'_>,
        registration: u64,
        blocks: Vec<u64>,
        params: &[u8],
    ) -> PyResult<u64> {
        let p = GpuTransferParams::from_msgpack(params)
            .map_err(|e| PyValueError::new_err(e.message))?;
        py.detach(|| self.inner.gpu_pull(registration, &blocks, &p))
            .map_err(err)
    }

    /// Where this session's `gpu_export` stands: `{"state", "message"}`.
    fn gpu_export_status<'py>(
        &self,
        py: Python<'py>,
        transfer_id: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let r = py
            .detach(|| self.inner.gpu_export_status(transfer_id))
            .map_err(err)?;
        to_py(py, &r)
    }

    /// The shared pool, as a writable buffer (`memoryview(client.pool())`); `None` when
    /// the pool is not mapped. Valid until the daemon restarts (`incarnation` changes).
    fn pool(&self) -> Option<Pool> {
        self.inner.pool_region().map(|region| Pool { region })
    }
}

/// Slots reserved by `Client.alloc`.
#[pyclass(module = "kvd._native")]
struct Batch {
    inner: Mutex<Option<WriteBatch>>,
}

impl Batch {
    fn with<R>(&self, f: impl FnOnce(&WriteBatch) -> R) -> PyResult<R> {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.as_ref()
            .map(f)
            .ok_or_else(|| PyValueError::new_err("the batch was committed or aborted"))
    }

    fn take(&self) -> PyResult<WriteBatch> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| PyValueError::new_err("the batch was committed or aborted"))
    }
}

#[pymethods]
impl Batch {
    /// Per key: "new" (write it), "exists", "busy".
    #[getter]
    fn status(&self) -> PyResult<Vec<&'static str>> {
        self.with(|b| b.status().iter().map(status_str).collect())
    }

    /// Per key: the slot's offset in `pool()` for "new" keys, else `None`.
    #[getter]
    fn offsets(&self) -> PyResult<Vec<Option<u64>>> {
        self.with(|b| b.offsets().to_vec())
    }

    /// Commits the written slots; returns how many.
    fn commit(&self, py: Python<'_>) -> PyResult<u64> {
        let b = self.take()?;
        py.detach(|| b.commit()).map_err(err)
    }

    /// Gives the slots back.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        let b = self.take()?;
        py.detach(|| b.abort()).map_err(err)
    }
}

/// Blocks pinned by `Client.get`.
#[pyclass(module = "kvd._native")]
struct Pinned {
    inner: Mutex<Option<PinnedBlocks>>,
}

#[pymethods]
impl Pinned {
    /// Per key: the block's offset in `pool()`, `None` for a miss.
    #[getter]
    fn offsets(&self) -> PyResult<Vec<Option<u64>>> {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.as_ref()
            .map(|p| p.offsets().to_vec())
            .ok_or_else(|| PyValueError::new_err("released"))
    }

    /// Per key: the block's writer checksum (SPEC §17), `None` for a miss or a block
    /// stored without one.
    #[getter]
    fn crcs(&self) -> PyResult<Vec<Option<u32>>> {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let p = g
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("released"))?;
        Ok((0..p.offsets().len()).map(|i| p.crc(i)).collect())
    }

    /// Checks every hit in place against its writer checksum (SPEC §17; a read of each
    /// block, without the GIL): per key `False` when its bytes do not match (a miss:
    /// name it in `Client.verify`), `True` when they do, `None` for a miss, a block
    /// without a checksum, or a client whose loads are not verified (`KVD_VERIFY_LOADS`).
    fn verify(&self, py: Python<'_>) -> PyResult<Vec<Option<bool>>> {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let p = g
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("released"))?;
        py.detach(|| p.check()).map_err(err)
    }

    /// The pin's id (`None` when nothing was pinned).
    #[getter]
    fn pin(&self) -> Option<u64> {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.as_ref().and_then(|p| p.pin()).map(|p| p.0)
    }

    /// Whether the pin still holds (bytes read after it lapsed must be discarded).
    #[getter]
    fn valid(&self) -> bool {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.as_ref().is_some_and(|p| p.is_valid())
    }

    /// Releases the pin.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let p = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        match p {
            Some(p) => py.detach(|| p.release()).map_err(err),
            None => Ok(()),
        }
    }
}

/// The pool mapping, exposed through the buffer protocol (writable, bytes).
#[pyclass(module = "kvd._native")]
struct Pool {
    region: PoolRegion,
}

#[pymethods]
impl Pool {
    fn __len__(&self) -> usize {
        self.region.len()
    }

    /// The mapping's address in this process (for `cudaHostRegister`; see
    /// `kvd.torch_pool`).
    #[getter]
    fn address(&self) -> usize {
        self.region.as_ptr() as usize
    }

    /// # Safety
    /// Called by Python with a valid `Py_buffer` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len) = {
            let b = slf.borrow();
            (b.region.as_ptr(), b.region.len())
        };
        let len = pyo3::ffi::Py_ssize_t::try_from(len)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        // SAFETY: `view` is the buffer Python asked us to fill; `ptr..+len` is the live
        // pool mapping, which `slf` (referenced by `view.obj`, so alive as long as any
        // view) keeps mapped through its `PoolRegion`. Writable (readonly = 0): the pool
        // is shared memory engines write by design (SPEC §8).
        let r =
            unsafe { pyo3::ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr.cast(), len, 0, flags) };
        if r != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }
}

/// The SPEC §3.2 chained chunk hashes of `tokens`, one per full block of
/// `tokens_per_block` (a trailing partial block has none).
#[pyfunction]
fn chunk_hashes<'py>(
    py: Python<'py>,
    tokens: Vec<u32>,
    tokens_per_block: usize,
    seed: &[u8],
) -> PyResult<Bound<'py, PyList>> {
    if tokens_per_block == 0 {
        return Err(PyValueError::new_err("tokens_per_block must be > 0"));
    }
    let hs = kvd_protocol::hash::chunk_hashes(&tokens, tokens_per_block, seed);
    PyList::new(py, hs.iter().map(|h| PyBytes::new(py, &h.0)))
}

/// A layout's stable id (what `register_layout` answers), computed locally.
#[pyfunction]
fn layout_id(py: Python<'_>, layout: &Bound<'_, PyDict>) -> PyResult<u64> {
    Ok(layout_of(py, layout)?.id().0)
}

/// The identity of the checkpoint at `path` (a directory or one weight file) for a
/// layout's `model` (SPEC §3.1, "Model identity"). `OSError` when it has no weight file or
/// cannot be read. The GIL is released while it reads.
#[pyfunction]
fn model_identity(py: Python<'_>, path: std::path::PathBuf) -> PyResult<String> {
    py.detach(|| kvd_client::model_identity(&path))
        .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("{}: {e}", path.display())))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Client>()?;
    m.add_class::<Batch>()?;
    m.add_class::<Pinned>()?;
    m.add_class::<Pool>()?;
    m.add_function(wrap_pyfunction!(chunk_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(layout_id, m)?)?;
    m.add_function(wrap_pyfunction!(model_identity, m)?)?;
    m.add("KvdError", m.py().get_type::<KvdError>())?;
    Ok(())
}
