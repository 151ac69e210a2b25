// Launcher of the split-K decode kernel and its reduction.
#include "cuda/decode_kernel.cuh"
#include "cuda/dispatch.h"
#include "cuda/launch.h"

namespace trtpaged {
namespace cuda {

cudaError_t launch_decode(const PagedArgs& a, const DecodePlan& p, trtpaged_dtype io, trtpaged_dtype kv,
                          cudaStream_t stream) {
  if (a.num_seqs <= 0 || a.num_tokens <= 0) return cudaSuccess;
  const dim3 grid(a.num_seqs, a.num_kv_heads * p.head_tiles, p.num_splits);
  const dim3 block(kDecodeLanes * p.heads_per_cta * p.rows_z);
  const bool ok = with_kernel_types(a.head_dim, io, kv, [&](auto dim, auto io_tag, auto kv_tag) {
    constexpr int D = decltype(dim)::value;
    using IoT = typename decltype(io_tag)::type;
    using KvT = typename decltype(kv_tag)::type;
    decode_kernel<D, IoT, KvT><<<grid, block, 0, stream>>>(a, p);
  });
  if (!ok) return cudaErrorInvalidValue;
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits <= 1) return err;
  with_dtype(io, [&](auto io_tag) {
    using IoT = typename decltype(io_tag)::type;
    decode_reduce_kernel<IoT><<<dim3(a.num_seqs, a.num_heads), 128, 0, stream>>>(a, p);
  });
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace trtpaged
