//! [`NcclGroup`]'s [`ProcessGroup`] collectives: each one call to the group's flat / grouped
//! point-to-point helpers in `mod.rs`, on the communication stream.

use super::*;

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let (t, host) = self.check(t, "all_gather")?;
        let (a, n, e) = around(t.dims(), dim, "all_gather")?;
        let p = self.size;
        let g = self.flat(&t, Shape::from((p, a, n * e)), Flat::AllGather)?;
        self.back(gathered(g, a, t.dims(), dim, p)?, host, "all_gather")
    }

    fn all_gather_start(&self, t: &Tensor, dim: usize) -> Result<Box<dyn PendingRecv>> {
        let (t, host) = self.check(t, "all_gather_start")?;
        let (a, n, e) = around(t.dims(), dim, "all_gather_start")?;
        let p = self.size;
        let (g, event) = self.flat_with(&t, Shape::from((p, a, n * e)), Flat::AllGather, false)?;
        let dims = t.dims().to_vec();
        let mut r = self.pending("all_gather_start", g, host, event, t);
        r.then = Some(Box::new(move |g| gathered(g, a, &dims, dim, p)));
        Ok(r)
    }

    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let (t, host) = self.check(t, "reduce_scatter")?;
        let (packed, out) = self.scatter_input(&t, dim, "reduce_scatter")?;
        self.back(self.flat(&packed, out, Flat::ReduceScatter)?, host, "reduce_scatter")
    }

    fn all_reduce(&self, t: &Tensor) -> Result<Tensor> {
        let (t, host) = self.check(t, "all_reduce")?;
        self.back(self.flat(&t, t.shape().clone(), Flat::AllReduce)?, host, "all_reduce")
    }

    fn all_reduce_start(&self, t: &Tensor) -> Result<Box<dyn PendingRecv>> {
        let (t, host) = self.check(t, "all_reduce_start")?;
        let (out, event) = self.flat_with(&t, t.shape().clone(), Flat::AllReduce, false)?;
        Ok(self.pending("all_reduce_start", out, host, event, t))
    }

    fn reduce_scatter_start(&self, t: &Tensor, dim: usize) -> Result<Box<dyn PendingRecv>> {
        let (t, host) = self.check(t, "reduce_scatter_start")?;
        // (the packing copy runs on the compute stream, which the comm stream waits for)
        let (packed, out) = self.scatter_input(&t, dim, "reduce_scatter_start")?;
        let (out, event) = self.flat_with(&packed, out, Flat::ReduceScatter, false)?;
        Ok(self.pending("reduce_scatter_start", out, host, event, packed))
    }

    fn all_to_all(&self, t: &Tensor, split_dim: usize, concat_dim: usize) -> Result<Tensor> {
        let (t, host) = self.check(t, "all_to_all")?;
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
        let (outs, ev) = self.p2p("all_to_all", &sends, &recvs, t.dtype())?;
        self.compute().wait(&ev).w()?;
        self.back(Tensor::cat(&outs, concat_dim)?, host, "all_to_all")
    }

    /// Grouped send/recv of the chunks as they are (no padding: each pair's rows only; a pair
    /// with no rows sends nothing).
    fn all_to_all_v(&self, t: &Tensor, send_rows: &[usize], recv_rows: &[usize]) -> Result<Tensor> {
        crate::group::check_all_to_all_v(self, t, send_rows, recv_rows)?;
        let (t, host) = self.check(t, "all_to_all_v")?;
        let rest = &t.dims()[1..];
        let mut sends = Vec::new();
        let mut off = 0;
        for (j, &n) in send_rows.iter().enumerate() {
            if n > 0 {
                sends.push((t.narrow(0, off, n)?.contiguous()?, j));
            }
            off += n;
        }
        let shape = |n: usize| Shape::from([&[n][..], rest].concat());
        let recvs: Vec<(Shape, usize)> = recv_rows.iter().enumerate().filter(|(_, &n)| n > 0).map(|(i, &n)| (shape(n), i)).collect();
        let (outs, ev) = self.p2p("all_to_all_v", &sends, &recvs, t.dtype())?;
        self.compute().wait(&ev).w()?;
        let out = if outs.is_empty() { Tensor::zeros(shape(1), t.dtype(), &self.device())? } else { Tensor::cat(&outs, 0)? };
        self.back(out, host, "all_to_all_v")
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root >= self.size {
            candle_core::bail!("broadcast: root {root} out of range for group size {}", self.size)
        }
        let (t, host) = self.check(t, "broadcast")?;
        self.back(self.flat(&t, t.shape().clone(), Flat::Broadcast(root))?, host, "broadcast")
    }

    fn barrier(&self) -> Result<()> {
        let x = Tensor::zeros(1, DType::F32, &self.device())?;
        self.all_reduce(&x)?;
        self.sync_op("barrier")
    }

    fn send_recv(&self, t: &Tensor, dst: usize, src: usize) -> Result<Box<dyn PendingRecv>> {
        if dst >= self.size || src >= self.size {
            candle_core::bail!("send_recv: dst {dst} / src {src} out of range for group size {}", self.size)
        }
        let (t, host) = self.check(t, "send_recv")?;
        let (mut outs, event) = self.p2p("send_recv", &[(t.clone(), dst)], &[(t.shape().clone(), src)], t.dtype())?;
        let out = outs.pop().ok_or_else(|| candle_core::Error::Msg("send_recv: no receive buffer".into()))?;
        Ok(self.pending("send_recv", out, host, event, t))
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn ProcessGroup>> {
        // 1. everyone learns (color, key) of every rank. Host tensors: the gathers check the
        //    group's health after their copy back (a watchdog abort or a dead peer is an Err).
        let me = Tensor::new(&[color as u32, key as u32], &Device::Cpu)?;
        let all = self.all_gather(&me, 0)?.to_vec1::<u32>()?;
        let mut members: Vec<(u32, usize)> =
            (0..self.size).filter(|&r| all[2 * r] == color as u32).map(|r| (all[2 * r + 1], r)).collect();
        members.sort();
        let new_rank = members.iter().position(|&(_, r)| r == self.rank).unwrap_or(0);
        let leader = members.first().map(|&(_, r)| r).unwrap_or(self.rank);
        // 2. each color's leader makes a unique id; ids travel through an all-gather.
        let mine: Vec<u8> = if leader == self.rank {
            let id = Id::new().map_err(|e| candle_core::Error::Msg(format!("split: ncclGetUniqueId: {}", raw::describe(e.0))))?;
            id.internal().iter().map(|&c| c as u8).collect()
        } else {
            vec![0u8; 128]
        };
        let ids = self.all_gather(&Tensor::new(mine.as_slice(), &Device::Cpu)?, 0)?.to_vec1::<u8>()?;
        let mut id = [0 as std::ffi::c_char; 128];
        for (d, s) in id.iter_mut().zip(&ids[128 * leader..128 * leader + 128]) {
            *d = *s as std::ffi::c_char;
        }
        // 3. the sub-communicator (collective over its members), with this group's timeout.
        Ok(Arc::new(NcclGroup::with_timeout(&self.device, new_rank, members.len(), Id::uninit(id), self.timeout())?))
    }

    fn home_device(&self) -> Option<Device> {
        Some(self.device())
    }

    fn describe(&self) -> String {
        let mode = if self.raw.blocking { ", blocking fallback" } else { "" };
        let state = if self.raw.poison.is_poisoned() { ", failed" } else { "" };
        format!("{} (timeout {:?}{mode}{state})", self.raw.label, self.timeout())
    }
}
