//! [`NcclGroup`]: the [`ProcessGroup`] collectives over NCCL (cudarc's bindings, re-exported
//! by candle-core as `candle_core::cuda_backend::cudarc`). Feature `nccl`.
//!
//! - Every collective runs on a dedicated **communication stream**. Before it, the comm stream
//!   waits for the compute stream (candle's stream of the group's device) with an event; after
//!   a blocking collective the compute stream waits for the comm stream, so the result is safe
//!   to use from candle. [`ProcessGroup::send_recv`] does not make the compute stream wait:
//!   its [`PendingRecv::wait`] does, so compute issued in between overlaps the transfer.
//! - Ring send/recv and all-to-all are grouped NCCL send/recv (`ncclGroupStart/End`); NCCL
//!   has no all-to-all. all-gather / reduce-scatter along a dim other than 0 reorder the data
//!   with candle ops (a transpose copy) around NCCL's flat collectives.
//! - Bootstrap: [`NcclGroup::from_env`] (one process per GPU: `RANK`, `WORLD_SIZE`,
//!   `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`; the NCCL unique id goes through a shared file,
//!   see [`id_file_path`]), [`NcclGroup::new`] (you pass the id), or
//!   [`NcclGroup::single_process`] / [`run_nccl_ranks`] (one thread per GPU in one process).
//! - NCCL refuses two ranks on the same GPU: several ranks on one GPU use
//!   [`crate::ThreadGroup`] with a CUDA device instead (virtual ranks).
//!
//! Dtypes: f32, f64, f16, bf16, u8, u32, i64 (sums for f32/f64/f16/bf16/u8/u32/i64).

use crate::{Group, PendingRecv, ProcessGroup};
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream};
use candle_core::cuda_backend::cudarc::nccl::{self, Comm, Id, ReduceOp};
use candle_core::cuda_backend::WrapErr;
use candle_core::backend::BackendDevice;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Result, Shape, Storage, Tensor};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn nerr(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("nccl {what}: {e:?}"))
}

/// Dtype dispatch for the NCCL-supported dtypes.
macro_rules! dispatch {
    ($dt:expr, $what:expr, $go:ident) => {
        match $dt {
            DType::F32 => $go!(f32),
            DType::F64 => $go!(f64),
            DType::F16 => $go!(half::f16),
            DType::BF16 => $go!(half::bf16),
            DType::U8 => $go!(u8),
            DType::U32 => $go!(u32),
            DType::I64 => $go!(i64),
            dt => candle_core::bail!("{}: dtype {dt:?} not supported by NcclGroup", $what),
        }
    };
}

/// cudarc's `Comm` holds a raw communicator pointer (neither `Send` nor `Sync`). We only use it
/// behind a `Mutex`, one call at a time, which is what NCCL requires of a communicator.
struct CommBox(Comm);
// SAFETY: the communicator is only touched while holding the group's Mutex.
unsafe impl Send for CommBox {}

/// A rank of an NCCL communicator, as a [`ProcessGroup`]. Tensors must live on
/// [`NcclGroup::device`].
pub struct NcclGroup {
    comm: Mutex<CommBox>,
    rank: usize,
    size: usize,
    device: CudaDevice,
    comm_stream: Arc<CudaStream>,
}

/// Where [`NcclGroup::from_env`] exchanges the unique id: `$CANDLE_CP_NCCL_ID_FILE` if set,
/// else `$TMPDIR` (or `/tmp`) `/candle-cp-nccl-<MASTER_ADDR>-<MASTER_PORT>.id`. Rank 0 writes it
/// (atomically, by rename), the others poll for it. For several nodes the path must be on a
/// filesystem every node sees; `MASTER_ADDR`/`MASTER_PORT` only name the file (no TCP store).
pub fn id_file_path() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("CANDLE_CP_NCCL_ID_FILE") {
        return p.into();
    }
    let addr = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "localhost".into());
    let port = std::env::var("MASTER_PORT").unwrap_or_else(|_| "29500".into());
    std::env::temp_dir().join(format!("candle-cp-nccl-{addr}-{port}.id"))
}

fn env_usize(name: &str) -> Result<usize> {
    let v = std::env::var(name).map_err(|_| candle_core::Error::Msg(format!("NcclGroup::from_env: {name} is not set")))?;
    v.trim().parse().map_err(|_| candle_core::Error::Msg(format!("NcclGroup::from_env: {name}={v:?} is not a number")))
}

impl NcclGroup {
    /// Join communicator `id` as `rank` of `world_size`, on `device` (the compute device).
    /// Blocks until all `world_size` ranks have joined.
    pub fn new(device: &CudaDevice, rank: usize, world_size: usize, id: Id) -> Result<Self> {
        if rank >= world_size {
            candle_core::bail!("NcclGroup::new: rank {rank} out of range for world size {world_size}")
        }
        let ctx = device.cuda_stream().context().clone();
        ctx.bind_to_thread().w()?; // ncclCommInitRank uses the calling thread's current device
        let comm_stream = ctx.new_stream().w()?;
        let comm = Comm::from_rank(comm_stream.clone(), rank, world_size, id).map_err(|e| nerr("init rank", e))?;
        Ok(Self { comm: Mutex::new(CommBox(comm)), rank, size: world_size, device: device.clone(), comm_stream })
    }

    /// One process per GPU, from the usual launcher environment: `RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK` (the CUDA ordinal; default `RANK`). The unique id is exchanged through
    /// [`id_file_path`]; ranks other than 0 wait for it up to `timeout`.
    pub fn from_env(timeout: Duration) -> Result<Self> {
        let rank = env_usize("RANK")?;
        let world = env_usize("WORLD_SIZE")?;
        let local = env_usize("LOCAL_RANK").unwrap_or(rank);
        let device = CudaDevice::new_with_stream(local)?;
        let path = id_file_path();
        let id = if rank == 0 {
            let id = Id::new().map_err(|e| nerr("unique id", e))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, &bytes)?;
            std::fs::rename(&tmp, &path)?;
            id
        } else {
            let start = Instant::now();
            loop {
                match std::fs::read(&path) {
                    Ok(b) if b.len() == 128 => {
                        let mut raw = [0 as std::ffi::c_char; 128];
                        for (d, s) in raw.iter_mut().zip(&b) {
                            *d = *s as std::ffi::c_char;
                        }
                        break Id::uninit(raw);
                    }
                    _ if start.elapsed() > timeout => candle_core::bail!(
                        "NcclGroup::from_env: rank {rank} found no NCCL id at {} after {timeout:?}",
                        path.display()
                    ),
                    _ => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        };
        Self::new(&device, rank, world, id)
    }

    /// All GPUs `ordinals` in this process, one rank each (rank `i` on `ordinals[i]`), through
    /// `ncclCommInitAll`. Drive each group from its own thread (see [`run_nccl_ranks`]).
    pub fn single_process(ordinals: &[usize]) -> Result<Vec<Arc<NcclGroup>>> {
        let mut devices = Vec::with_capacity(ordinals.len());
        let mut streams = Vec::with_capacity(ordinals.len());
        for &o in ordinals {
            let d = CudaDevice::new_with_stream(o)?;
            streams.push(d.cuda_stream().context().new_stream().w()?);
            devices.push(d);
        }
        let comms = Comm::from_devices(streams.clone()).map_err(|e| nerr("init all", e))?;
        let size = comms.len();
        Ok(comms
            .into_iter()
            .zip(devices)
            .zip(streams)
            .enumerate()
            .map(|(rank, ((comm, device), comm_stream))| {
                Arc::new(NcclGroup { comm: Mutex::new(CommBox(comm)), rank, size, device, comm_stream })
            })
            .collect())
    }

    /// The candle device the group computes on (create tensors here).
    pub fn device(&self) -> Device {
        Device::Cuda(self.device.clone())
    }

    fn compute(&self) -> Arc<CudaStream> {
        self.device.cuda_stream()
    }

    /// Comm stream waits for the compute stream (inputs and fresh outputs are ready).
    fn enter(&self) -> Result<()> {
        self.comm_stream.join(&self.compute()).w()
    }

    /// Compute stream waits for everything queued on the comm stream so far.
    fn leave(&self) -> Result<()> {
        self.compute().join(&self.comm_stream).w()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CommBox> {
        self.comm.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check(&self, t: &Tensor, op: &str) -> Result<Tensor> {
        match t.device() {
            Device::Cuda(d) if d.same_device(&self.device) => {}
            other => candle_core::bail!("{op}: tensor {:?} is on {other:?}, the group's device is {:?}", t.shape(), self.device),
        }
        t.contiguous()
    }

    /// Flat NCCL collective from `src` (contiguous) into a fresh buffer of the same dtype with
    /// `out_shape`'s element count.
    fn flat(&self, src: &Tensor, out_shape: Shape, kind: Flat) -> Result<Tensor> {
        let n = out_shape.elem_count();
        let storage = {
            let (ss, sl) = src.storage_and_layout();
            let Storage::Cuda(ss) = &*ss else { candle_core::bail!("{}: input is not on a CUDA device", kind.name()) };
            let Some((a, b)) = sl.contiguous_offsets() else {
                candle_core::bail!("{}: input {:?} is not contiguous", kind.name(), src.shape())
            };
            macro_rules! go {
                ($ty:ty) => {{
                    let s = ss.as_cuda_slice::<$ty>()?.slice(a..b);
                    let mut o = self.device.alloc_zeros::<$ty>(n)?;
                    self.enter()?;
                    let guard = self.lock();
                    let comm = &guard.0;
                    match kind {
                        Flat::AllGather => comm.all_gather(&s, &mut o).map(|_| ()),
                        Flat::AllReduce => comm.all_reduce(&s, &mut o, &ReduceOp::Sum).map(|_| ()),
                        Flat::ReduceScatter => comm.reduce_scatter(&s, &mut o, &ReduceOp::Sum).map(|_| ()),
                        Flat::Broadcast(root) => comm.broadcast(Some(&s), &mut o, root as i32).map(|_| ()),
                    }
                    .map_err(|e| nerr(kind.name(), e))?;
                    CudaStorage::wrap_cuda_slice(o, self.device.clone())
                }};
            }
            dispatch!(src.dtype(), kind.name(), go)
        };
        self.leave()?;
        Ok(Tensor::from_storage(Storage::Cuda(storage), out_shape, BackpropOp::none(), false))
    }

    /// Grouped send/recv: send `sends[i] = (tensor, peer)`, receive into fresh tensors shaped
    /// like `recvs[i] = (shape, peer)`. Returns the received tensors and an event recorded on
    /// the comm stream after the group (the compute stream is NOT made to wait).
    fn p2p(&self, sends: &[(Tensor, usize)], recvs: &[(Shape, usize)], dtype: DType) -> Result<(Vec<Tensor>, CudaEvent)> {
        let sg: Vec<_> = sends.iter().map(|(t, _)| t.storage_and_layout()).collect();
        macro_rules! go {
            ($ty:ty) => {{
                let mut views = Vec::with_capacity(sends.len());
                for ((st, l), (t, _)) in sg.iter().zip(sends) {
                    let Storage::Cuda(c) = &**st else { candle_core::bail!("send: tensor {:?} is not on CUDA", t.shape()) };
                    let Some((a, b)) = l.contiguous_offsets() else {
                        candle_core::bail!("send: tensor {:?} is not contiguous", t.shape())
                    };
                    views.push(c.as_cuda_slice::<$ty>()?.slice(a..b));
                }
                let mut bufs = recvs
                    .iter()
                    .map(|(s, _)| self.device.alloc_zeros::<$ty>(s.elem_count()))
                    .collect::<Result<Vec<_>>>()?;
                self.enter()?;
                let guard = self.lock();
                let comm = &guard.0;
                nccl::group_start().map_err(|e| nerr("group start", e))?;
                let mut res = Ok(());
                for (v, (_, peer)) in views.iter().zip(sends) {
                    if res.is_ok() {
                        res = comm.send(v, *peer as i32).map_err(|e| nerr("send", e));
                    }
                }
                for (buf, (_, peer)) in bufs.iter_mut().zip(recvs) {
                    if res.is_ok() {
                        res = comm.recv(buf, *peer as i32).map(|_| ()).map_err(|e| nerr("recv", e));
                    }
                }
                let end = nccl::group_end().map_err(|e| nerr("group end", e));
                res?;
                end?;
                drop(guard);
                bufs.into_iter()
                    .zip(recvs)
                    .map(|(b, (s, _))| {
                        let st = CudaStorage::wrap_cuda_slice(b, self.device.clone());
                        Tensor::from_storage(Storage::Cuda(st), s.clone(), BackpropOp::none(), false)
                    })
                    .collect::<Vec<_>>()
            }};
        }
        let outs = dispatch!(dtype, "send/recv", go);
        let ev = self.comm_stream.record_event(None).w()?;
        Ok((outs, ev))
    }
}

#[derive(Clone, Copy)]
enum Flat {
    AllGather,
    AllReduce,
    ReduceScatter,
    Broadcast(usize),
}

impl Flat {
    fn name(&self) -> &'static str {
        match self {
            Flat::AllGather => "all_gather",
            Flat::AllReduce => "all_reduce",
            Flat::ReduceScatter => "reduce_scatter",
            Flat::Broadcast(_) => "broadcast",
        }
    }
}

/// `[d0.., N, ..]` viewed as `(A, N, E)` around `dim`.
fn around(dims: &[usize], dim: usize, op: &str) -> Result<(usize, usize, usize)> {
    if dim >= dims.len() {
        candle_core::bail!("{op}: dim {dim} out of range for shape {dims:?}")
    }
    Ok((dims[..dim].iter().product(), dims[dim], dims[dim + 1..].iter().product()))
}

struct NcclRecv {
    out: Tensor,
    event: CudaEvent,
    compute: Arc<CudaStream>,
    _send: Tensor,
}

impl PendingRecv for NcclRecv {
    fn wait(self: Box<Self>) -> Result<Tensor> {
        self.compute.wait(&self.event).w()?;
        Ok(self.out)
    }
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let t = self.check(t, "all_gather")?;
        let (a, n, e) = around(t.dims(), dim, "all_gather")?;
        let p = self.size;
        let g = self.flat(&t, Shape::from((p, a, n * e)), Flat::AllGather)?;
        let mut dims = t.dims().to_vec();
        dims[dim] *= p;
        if a == 1 {
            return g.reshape(dims);
        }
        g.transpose(0, 1)?.contiguous()?.reshape(dims)
    }

    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let t = self.check(t, "reduce_scatter")?;
        let (a, n, e) = around(t.dims(), dim, "reduce_scatter")?;
        let p = self.size;
        if n % p != 0 {
            candle_core::bail!("reduce_scatter: dim {dim} of {:?} must divide by the group size {p}", t.shape())
        }
        let packed = if a == 1 { t.clone() } else { t.reshape((a, p, n / p * e))?.transpose(0, 1)?.contiguous()? };
        let mut dims = t.dims().to_vec();
        dims[dim] /= p;
        self.flat(&packed, Shape::from(dims), Flat::ReduceScatter)
    }

    fn all_reduce(&self, t: &Tensor) -> Result<Tensor> {
        let t = self.check(t, "all_reduce")?;
        self.flat(&t, t.shape().clone(), Flat::AllReduce)
    }

    fn all_to_all(&self, t: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor> {
        let t = self.check(t, "all_to_all")?;
        let p = self.size;
        let (a, n, e) = around(t.dims(), split_dim, "all_to_all")?;
        around(t.dims(), concat_dim, "all_to_all")?;
        if n % p != 0 {
            candle_core::bail!("all_to_all: split dim {split_dim} of {:?} must divide by the group size {p}", t.shape())
        }
        let mut chunk_dims = t.dims().to_vec();
        chunk_dims[split_dim] /= p;
        let packed = t.reshape((a, p, n / p * e))?.transpose(0, 1)?.contiguous()?;
        let sends = (0..p).map(|j| Ok((packed.get(j)?.reshape(chunk_dims.as_slice())?, j))).collect::<Result<Vec<_>>>()?;
        let recvs: Vec<(Shape, usize)> = (0..p).map(|j| (Shape::from(chunk_dims.as_slice()), j)).collect();
        let (outs, ev) = self.p2p(&sends, &recvs, t.dtype())?;
        self.compute().wait(&ev).w()?;
        Tensor::cat(&outs, concat_dim)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root >= self.size {
            candle_core::bail!("broadcast: root {root} out of range for group size {}", self.size)
        }
        let t = self.check(t, "broadcast")?;
        self.flat(&t, t.shape().clone(), Flat::Broadcast(root))
    }

    fn barrier(&self) -> Result<()> {
        let x = Tensor::zeros(1, DType::F32, &self.device())?;
        self.all_reduce(&x)?;
        self.compute().synchronize().w()
    }

    fn send_recv(&self, t: &Tensor, dst: usize, src: usize) -> Result<Box<dyn PendingRecv>> {
        if dst >= self.size || src >= self.size {
            candle_core::bail!("send_recv: dst {dst} / src {src} out of range for group size {}", self.size)
        }
        let t = self.check(t, "send_recv")?;
        let (mut outs, event) = self.p2p(&[(t.clone(), dst)], &[(t.shape().clone(), src)], t.dtype())?;
        let out = outs.pop().ok_or_else(|| candle_core::Error::Msg("send_recv: no receive buffer".into()))?;
        Ok(Box::new(NcclRecv { out, event, compute: self.compute(), _send: t }))
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn ProcessGroup>> {
        // 1. everyone learns (color, key) of every rank.
        let me = Tensor::new(&[color as u32, key as u32], &self.device())?;
        let all = self.all_gather(&me, 0)?.to_vec1::<u32>()?;
        let mut members: Vec<(u32, usize)> =
            (0..self.size).filter(|&r| all[2 * r] == color as u32).map(|r| (all[2 * r + 1], r)).collect();
        members.sort();
        let new_rank = members.iter().position(|&(_, r)| r == self.rank).unwrap_or(0);
        let leader = members.first().map(|&(_, r)| r).unwrap_or(self.rank);
        // 2. each color's leader makes a unique id; ids travel through an all-gather.
        let mine: Vec<u8> = if leader == self.rank {
            Id::new().map_err(|e| nerr("unique id", e))?.internal().iter().map(|&c| c as u8).collect()
        } else {
            vec![0u8; 128]
        };
        let ids = self.all_gather(&Tensor::new(mine.as_slice(), &self.device())?, 0)?.to_vec1::<u8>()?;
        let mut raw = [0 as std::ffi::c_char; 128];
        for (d, s) in raw.iter_mut().zip(&ids[128 * leader..128 * leader + 128]) {
            *d = *s as std::ffi::c_char;
        }
        // 3. the sub-communicator (collective over its members).
        Ok(Arc::new(NcclGroup::new(&self.device, new_rank, members.len(), Id::uninit(raw))?))
    }

    fn describe(&self) -> String {
        format!("nccl group (rank {} of {}, {:?})", self.rank, self.size, self.device)
    }
}

/// Run `f` on one NCCL rank per GPU of `ordinals` in this process (one thread each, created
/// with [`NcclGroup::single_process`]); element `r` is rank `r`'s result.
pub fn run_nccl_ranks<T: Send>(ordinals: &[usize], f: impl Fn(Group) -> Result<T> + Send + Sync) -> Result<Vec<Result<T>>> {
    let groups = NcclGroup::single_process(ordinals)?;
    let f = &f;
    Ok(std::thread::scope(|s| {
        let joins: Vec<_> = groups.into_iter().map(|g| s.spawn(move || f(g as Group))).collect();
        joins
            .into_iter()
            .enumerate()
            .map(|(r, j)| j.join().unwrap_or_else(|_| Err(candle_core::Error::Msg(format!("nccl rank {r} panicked")))))
            .collect()
    }))
}
