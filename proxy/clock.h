/*
 * clock.h - the monotonic clock as the proxy's threads use it: "now" in
 * milliseconds, a pthread_cond_timedwait deadline some milliseconds ahead,
 * and condition variables that wait on that clock (so a wall-clock step
 * never stretches or cuts a wait).
 */
#ifndef IDEM_CLOCK_H
#define IDEM_CLOCK_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

static inline int64_t idem_mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* CLOCK_MONOTONIC now + delay_ms (>= 0), for a cond made by
 * idem_cond_init_monotonic(). */
static inline struct timespec idem_deadline_in_ms(int64_t delay_ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += (time_t)(delay_ms / 1000);
    ts.tv_nsec += (long)(delay_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

static inline int idem_cond_init_monotonic(pthread_cond_t *c)
{
    pthread_condattr_t ca;
    int rc;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    rc = pthread_cond_init(c, &ca);
    pthread_condattr_destroy(&ca);
    return rc;
}

#endif
