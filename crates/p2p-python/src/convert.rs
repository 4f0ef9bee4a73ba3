//! Argument conversions shared by the Endpoint methods: vectors of
//! buffers, descriptors, same-host pairs, the GPU index.

use crate::*;

/// `(ptr, size)` pairs of a vector same-host call, checked against each
/// other (and against the number of descriptors where given).
pub(crate) fn ipc_pairs(
    ptr_v: &[u64],
    size_v: &[usize],
    infos: Option<usize>,
) -> EResult<Vec<(u64, usize)>> {
    if ptr_v.len() != size_v.len() || infos.is_some_and(|n| n != ptr_v.len()) {
        return Err(Error::Invalid(format!(
            "{} pointers, {} sizes{}: the lists must have one entry per buffer",
            ptr_v.len(),
            size_v.len(),
            infos
                .map(|n| format!(" and {n} descriptors"))
                .unwrap_or_default()
        )));
    }
    Ok(ptr_v.iter().copied().zip(size_v.iter().copied()).collect())
}

pub(crate) fn one(mr: u64, ptr: u64, len: usize) -> [Buf; 1] {
    [Buf { mr, ptr, len }]
}

/// The 64-byte descriptor argument `name` of a one-sided call.
pub(crate) fn fifo_arg(meta: &[u8], name: &str) -> PyResult<FifoItem> {
    if meta.len() != wire::FIFO_ITEM_LEN {
        return Err(InvalidArgumentError::new_err(format!(
            "{name}: must be exactly {} bytes (a descriptor from the peer's advertise), got {}",
            wire::FIFO_ITEM_LEN,
            meta.len()
        )));
    }
    fifo(meta).map_err(|e| to_py(&e))
}

pub(crate) fn two_sided(
    call: &str,
    mr_id_v: &[u64],
    data_ptr_v: &[u64],
    size_v: &[usize],
    n: usize,
) -> PyResult<Vec<Buf>> {
    check_lens(
        call,
        n,
        &[
            ("mr_id_v", mr_id_v.len()),
            ("data_ptr_v", data_ptr_v.len()),
            ("size_v", size_v.len()),
        ],
    )?;
    bufs(mr_id_v, data_ptr_v, size_v, n).map_err(|e| to_py(&e))
}

/// A GPU index given to `Endpoint()`: >= 0, and one of this machine's GPUs
/// where CUDA is present. Without CUDA any index is a label (a warning
/// says so for indices above 0).
pub(crate) fn gpu_index_arg(g: &Bound<'_, PyAny>) -> PyResult<i32> {
    let i = args::i64_named(g, "local_gpu_idx")?;
    if i < 0 {
        return Err(InvalidArgumentError::new_err(format!(
            "local_gpu_idx: {i} is not a GPU index (0 or more)"
        )));
    }
    let count = tcpx_p2p_gpu::device_count();
    if count > 0 && i >= count as i64 {
        return Err(InvalidArgumentError::new_err(format!(
            "local_gpu_idx: {i}, but this machine has {count} GPU(s) (0 to {})",
            count - 1
        )));
    }
    let i = i32::try_from(i).map_err(|_| {
        InvalidArgumentError::new_err(format!("local_gpu_idx: {i} is not a GPU index"))
    })?;
    if count == 0 && i > 0 {
        return Err(InvalidArgumentError::new_err(format!(
            "local_gpu_idx: {i}, but this machine has no usable GPU (CUDA unavailable); use 0 or None for host memory"
        )));
    }
    Ok(i)
}

pub(crate) fn vec_args(
    call: &str,
    mr_id_v: &[u64],
    ptr_v: &[u64],
    size_v: &[usize],
    meta_blob_v: &[Vec<u8>],
    n: usize,
) -> PyResult<(Vec<Buf>, Vec<FifoItem>)> {
    check_lens(
        call,
        n,
        &[
            ("mr_id_v", mr_id_v.len()),
            ("ptr_v", ptr_v.len()),
            ("size_v", size_v.len()),
            ("meta_blob_v", meta_blob_v.len()),
        ],
    )?;
    let b = bufs(mr_id_v, ptr_v, size_v, n).map_err(|e| to_py(&e))?;
    let m = meta_blob_v
        .iter()
        .enumerate()
        .map(|(i, m)| args::element("meta_blob_v", i, |n| fifo_arg(m, n)))
        .collect::<PyResult<Vec<_>>>()?;
    Ok((b, m))
}
