/* What the forward convolution kernels (direct_conv.h, winograd.h, depthwise.h) do to an output
 * as they store it: add the channel's bias and apply a ReLU (or a bounded one), so that neither
 * costs a pass over the output of its own; the max of two vectors that the pools (pools.h) and
 * Winograd's pooled store share; and the in-register transpose that moves LANES x LANES values
 * between planes and channels-last (Winograd's padded copy, depthwise.h's channel vectors). The
 * bias is added in the output's type and the ReLU is the activation kernel's (0 where v < 0, v
 * elsewhere: NaN stays NaN, -0 stays -0), so a fused output equals the separate passes' bit for
 * bit. */
#ifndef LAMINA_EPILOGUE_H
#define LAMINA_EPILOGUE_H

#define LAMINA_IMPL "epilogue_impl.h"
#include "instantiate.h"

#endif
