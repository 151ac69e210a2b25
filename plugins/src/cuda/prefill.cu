// Launcher of the prefill / mixed-batch attention kernel.
#include "cuda/dispatch.h"
#include "cuda/launch.h"
#include "cuda/prefill_kernel.cuh"

namespace trtpaged {
namespace cuda {

cudaError_t launch_prefill(const PagedArgs& a, const PrefillPlan& p, trtpaged_dtype io, trtpaged_dtype kv,
                           cudaStream_t stream) {
  if (a.num_tokens < 2 || p.max_work_items <= 0) return cudaSuccess;  // no sequence can have q_len >= 2
  const dim3 grid(p.max_work_items, a.num_kv_heads * p.head_tiles);
  const bool ok = with_kernel_types(a.head_dim, io, kv, [&](auto dim, auto io_tag, auto kv_tag) {
    constexpr int D = decltype(dim)::value;
    using IoT = typename decltype(io_tag)::type;
    using KvT = typename decltype(kv_tag)::type;
    prefill_kernel<D, IoT, KvT><<<grid, kPrefillThreads, 0, stream>>>(a, p);
  });
  if (!ok) return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace trtpaged
