/* metrics.h - the engine's counters and histograms (kiln_metrics_t in kiln/kiln.h) and their
 * upkeep. The engine thread owns one kiln_metrics_t and updates it under the engine's
 * metrics lock; readers get a copy (kiln_engine_get_metrics).
 *
 * Histogram buckets (upper bounds; the +Inf bucket is implicit):
 *   time_to_first_token, queue_time, e2e_latency: seconds, from 1 ms to 20 min
 *   inter_token_latency: seconds, from 1 ms to 80 s
 *   tokens_per_step: tokens, from 1 to 16384
 */
#ifndef KILN_CORE_ENGINE_METRICS_H
#define KILN_CORE_ENGINE_METRICS_H

#include "kiln/kiln.h"

/* Zeroes m and sets every histogram's bucket bounds. */
void kiln_metrics_init(kiln_metrics_t *m);
/* Sets a histogram's bounds (ascending, at most KILN_HIST_MAX_BUCKETS) and zeroes it. */
void kiln_histogram_init(kiln_histogram_t *h, const double *bounds, int32_t num_bounds);
/* Adds one observation: the first bucket whose bound is >= v (or +Inf), count and sum.
 * NaN is ignored. */
void kiln_histogram_observe(kiln_histogram_t *h, double v);
/* The value below which a fraction q of observations fall, interpolated linearly inside
 * the bucket (as Prometheus's histogram_quantile); 0 when empty. */
double kiln_histogram_quantile(const kiln_histogram_t *h, double q);

#endif /* KILN_CORE_ENGINE_METRICS_H */
