/* Attention over packed sequences, one (sequence, head) at a time, in float (fast exp,
 * vectorised) and double (libm exp). */
#ifndef LAMINA_ATTENTION_H
#define LAMINA_ATTENTION_H
#include <math.h>
#include "clones.h"
#include "softmax.h"

/* keys whose scores are held at once: a query's scores against more keys are taken in blocks of
 * this many, with a running maximum and sum */
#define ATTENTION_BLOCK 128

#define LAMINA_IMPL "attention_impl.h"
#include "instantiate.h"

#endif
