/* Attention over packed sequences, one (sequence, head) at a time, in float (fast exp,
 * vectorised) and double (libm exp). */
#ifndef LAMINA_ATTENTION_H
#define LAMINA_ATTENTION_H
#include <math.h>
#include <string.h>
#include "clones.h"
#include "epilogue.h"
#include "softmax.h"

/* keys whose scores are held at once: a query's scores against more keys are taken in blocks of
 * this many, with a running maximum and sum */
#define ATTENTION_BLOCK 128
/* queries taken together, and keys (and value columns) per vector, in the forward's blocks */
#define ATTENTION_ROWS 4
#define ATTENTION_KEYS 16

/* the forward's scratch per thread for a sequence of n rows and heads of d: its keys
 * transposed with slack for the last group of keys, its scaled queries with a group of zero rows
 * after them, its values, and a group of rows' running outputs */
static inline long attention_scratch(long n, long d) {
    return d * n + ATTENTION_KEYS + (n + ATTENTION_ROWS) * d + n * d + ATTENTION_ROWS * d;
}

/* backward's: the keys and values transposed, each with slack; the scaled queries and the output
 * gradients, each with a group of zero rows after them; the keys; the keys' and values' gradient
 * sums; each row's output gradient · output; a group of rows' query gradients */
static inline long attention_backward_scratch(long n, long d) {
    return 2 * (d * n + ATTENTION_KEYS) + 2 * (n + ATTENTION_ROWS) * d + 3 * n * d + n + ATTENTION_ROWS * d;
}

#define LAMINA_IMPL "attention_impl.h"
#include "instantiate.h"

#endif
