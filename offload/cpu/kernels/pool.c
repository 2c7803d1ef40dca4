/* pool.c: the worker threads of the GGUF kernels (ggml_gemv.c, decode_stack.c), kept for the process.

Contract: pool_run(fn, arg, nth) calls fn(arg, i, nth) once for every i in [0, nth): i = 0 on the
calling thread, the others on workers, and returns when all have returned. Workers are created on
first need (at most POOL_MAX - 1) and live as long as the process; after fork the child starts
with none. One job at a time: a second caller waits for the first job to end (run_mu). fn must not
call pool_run. Why not OpenMP: libgomp cuts its workers' spin-wait to almost nothing when more of
its threads exist than CPUs (a server's decoding thread beside the main thread's team), and a worker
then sleeps between the ~120 parallel regions of a pass: 2-3x slower passes. Here an idle worker
spins for about SPIN polls (a few milliseconds: it stays awake between the regions of a pass and
between decoding steps), then sleeps on a condition variable until the next job. Every YIELD_EVERY
polls a spinning thread (worker or caller) yields its CPU (sched_yield): where more threads are
runnable than cores (the prefetcher's reads, another process), a spinner that never yields holds the
core the thread it waits for needs, and a pass of ~300 regions then costs a scheduler tick each
(measured: a 30-layer draft pass at 0.27-0.54 s instead of ~10 ms on a loaded 2-core machine). */

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#define POOL_MAX 256
#define SPIN 20000
#define YIELD_EVERY 256

typedef void (*pool_fn)(void *arg, int ith, int nth);

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER, run_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static atomic_uint gen;         /* bumped once per job (wrapping): workers wait for it to move */
static atomic_int pending;      /* workers that have not finished the current job */
static pool_fn job_fn;          /* the current job, written before gen moves */
static void *job_arg;
static int job_nth, started, forked_hook;
static unsigned birth[POOL_MAX];   /* each worker's generation at creation */

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void *worker(void *p) {
    /* birth[id]: the generation when it was made, so a worker that starts running after the job it
       was made for has begun still runs that job */
    int id = (int)(intptr_t)p;
    unsigned seen = birth[id];
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&gen, memory_order_acquire)) == seen) {
            if (++spins < SPIN) {
                if (spins % YIELD_EVERY == 0) sched_yield();
                else relax();
                continue;
            }
            pthread_mutex_lock(&mu);
            while ((g = atomic_load(&gen)) == seen) pthread_cond_wait(&cv, &mu);
            pthread_mutex_unlock(&mu);
            break;
        }
        seen = g;
        if (id < job_nth) job_fn(job_arg, id, job_nth);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_acq_rel);
    }
    return NULL;
}

static void after_fork_child(void) {   /* the child has none of the parent's workers */
    pthread_mutex_init(&mu, NULL);
    pthread_mutex_init(&run_mu, NULL);
    pthread_cond_init(&cv, NULL);
    started = 0;
}

static void grow(int want) {
    if (!forked_hook) {
        pthread_atfork(NULL, NULL, after_fork_child);
        forked_hook = 1;
    }
    while (started < want) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        birth[started + 1] = atomic_load(&gen);   /* written before the thread exists */
        int ok = pthread_create(&t, &at, worker, (void *)(intptr_t)(started + 1)) == 0;
        pthread_attr_destroy(&at);
        if (!ok) break;
        started++;
    }
}

void pool_run(pool_fn fn, void *arg, int nth) {
    if (nth > POOL_MAX) nth = POOL_MAX;
    if (nth <= 1) {
        fn(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&run_mu);
    grow(nth - 1);
    if (started < nth - 1) nth = started + 1;   /* fewer threads could be created: split over those */
    job_fn = fn, job_arg = arg, job_nth = nth;
    atomic_store(&pending, started);
    pthread_mutex_lock(&mu);
    atomic_fetch_add_explicit(&gen, 1, memory_order_release);
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    fn(arg, 0, nth);
    for (int spins = 1; atomic_load_explicit(&pending, memory_order_acquire) > 0; spins++) {
        if (spins % YIELD_EVERY == 0) sched_yield();
        else relax();
    }
    pthread_mutex_unlock(&run_mu);
}
