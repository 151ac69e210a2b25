// Host-side launchers of the attention kernels (one per .cu file). Each returns
// cudaErrorInvalidValue for a head_dim/dtype without kernels, else the launch status.
#pragma once

#include <cuda_runtime.h>

#include "cuda/paged_args.h"

namespace trtpaged {
namespace cuda {

cudaError_t launch_write_kv(const PagedArgs& a, trtpaged_dtype io, trtpaged_dtype kv, cudaStream_t stream);
cudaError_t launch_decode(const PagedArgs& a, const DecodePlan& p, trtpaged_dtype io, trtpaged_dtype kv,
                          cudaStream_t stream);
cudaError_t launch_prefill(const PagedArgs& a, const PrefillPlan& p, trtpaged_dtype io, trtpaged_dtype kv,
                           cudaStream_t stream);

}  // namespace cuda
}  // namespace trtpaged
