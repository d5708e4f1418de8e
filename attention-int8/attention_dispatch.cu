// The one entry point of the attention forward: routes the call to the kernel choose_attention_kernel picked.
#include "attention_int8.h"

namespace attention_int8 {

cudaError_t launch_attention_forward(const AttentionParams& p, cudaStream_t stream) {
  if (p.seqlen_q == 0 || p.batch == 0 || p.heads_q == 0) return cudaSuccess;
  switch (p.kernel) {
    case AttentionKernel::kSm90: return launch_attention_forward_sm90(p, stream);
    case AttentionKernel::kPortable: return launch_attention_forward_portable(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace attention_int8
