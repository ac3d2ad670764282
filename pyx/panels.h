/* Panel-packed GEMM for products with a fixed right-hand matrix and few rows on the left: the
 * recurrent step of RNN, LSTM and GRU (c[b x n] = h_prev[b x k] · W_hhᵀ, b <= batch size).
 *
 * A general BLAS packs its right-hand operand again on every call; for the step's shapes
 * (k = 512, n = 2048, b <= 64) that is a 4 MB copy per step for 134 MFLOP of work, and why
 * OpenBLAS ran the recurrent steps of a 512-wide LSTM at 60% of its own large-GEMM rate here.
 * This packs alpha·op(B) once (the caller caches the pack per weight version, as MKL's packed
 * GEMM is used) into panels of NR columns stored k-major, zero-padded to a whole panel:
 *
 *     panel p, row kk:  alpha · op(B)[kk, p·NR .. p·NR + NR)
 *
 * and computes MR x NR tiles of c in registers (NR = 64 bytes: 16 floats or 8 doubles): per kk,
 * two 32-byte loads of the panel, six broadcasts of a and twelve fused multiply-adds (MR = 6);
 * in the AVX-512 build one 64-byte load, eight broadcasts and eight multiply-adds on 64-byte
 * vectors (MR = 8: eight independent sums cover the FMA latency, and 512-bit FMAs do twice the
 * work of 256-bit ones at the same rate on CPUs with two 512-bit FMA units; the 1- and 2-row
 * tile sums four depths apart in four sets). A panel (k·NR values, 32 KB for k = 512) stays in
 * cache while every row tile of a passes over it. panel_gemm_team shares a product between a
 * team of threads (team.h), by runs of panels or by blocks of whole row tiles.
 *
 * Compiled for AVX2 + FMA, for AVX-512 and for the baseline (clones.h). */
#ifndef LAMINA_PANELS_H
#define LAMINA_PANELS_H

#include <string.h>
#include "clones.h"
#include "epilogue.h"
#include "team.h"

#if defined(LAMINA_TARGET_V4)
#define PANEL_MR 8
#else
#define PANEL_MR 6
#endif
/* Rows of a are taken in blocks of about this many bytes, every panel passing over one block
 * before the next: a block stays in the L2 cache while the panels stream through, where the
 * whole of a large a was read again from L3 for every panel. */
#define PANEL_ROW_BYTES (128 * 1024)
/* ...and the panels in runs of about this many bytes, every row block passing over one run
 * before the next: a run stays in the L2 cache with the row block, where a pack larger than the
 * cache was read again from L3 for every block of rows. */
#define PANEL_RUN_BYTES (256 * 1024)

#define LAMINA_IMPL "panels_impl.h"
#include "instantiate.h"

#endif
