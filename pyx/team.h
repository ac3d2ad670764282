/* A team of threads for one compiled call: lamina_team_run(threads, member, job) runs
 * member(job, t, nt) for t = 0 .. nt - 1 at once, t = 0 on the calling thread and the others on
 * worker threads of this pool, and returns when every member has returned.
 *
 * Why not lamina.threads.split_work (Python workers) or an OpenMP parallel region: on a virtual
 * machine, waking a sleeping thread costs tens of microseconds (its virtual CPU halts, and the
 * host must start it again), and a Python worker also waits for the GIL, which costs another
 * wake; an OpenMP region whose workers sleep at once (OMP_WAIT_POLICY=PASSIVE, which lamina sets
 * for OpenBLAS's sake) pays the wake too, where workers that spin do not. So the workers here never touch the GIL, and after each job
 * they watch for the next one for LAMINA_TEAM_SPIN seconds (lamina_team_set_spin) before they
 * sleep; while they watch they yield their CPU to any other thread that is ready to run on it, so
 * the spin costs the machine only idle time. lamina_team_rest() sends them to sleep at once (a
 * split_work run about to use their CPUs for Python workers).
 *
 * Members are placed like lamina.threads' workers: member t on the t-th CPU after the caller's,
 * when the process may use a CPU for each member (a woken thread otherwise went where the kernel
 * chose, at times onto the caller's own core, and the two took turns).
 *
 * One team runs at a time (a second caller waits its turn); a member that calls lamina_team_run
 * runs the inner team alone, as its only member (as a split_work run does). */
#ifndef LAMINA_TEAM_H
#define LAMINA_TEAM_H

#include <pthread.h>
#include <sched.h>
#include <time.h>

typedef void (*lamina_member)(void *job, int t, int nt);

#define LAMINA_TEAM_MAX 256

static struct {
    pthread_mutex_t turn;             /* one team at a time */
    pthread_mutex_t lock;             /* with `wake`: sleeping workers and a sleeping leader */
    pthread_cond_t wake;
    int workers;                      /* started so far */
    long generation;                  /* bumped by each team's start */
    long done;                        /* members other than 0 finished in this generation */
    lamina_member member;
    void *job;
    int nt, lead_cpu, rest;
    double spin;
    int cpus[LAMINA_TEAM_MAX], ncpus;  /* the CPUs the process may use, ascending */
} lamina_team = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                 0, 0, 0, 0, 0, 0, -1, 0, 1e-3, {0}, -1};

static long lamina_team_born[LAMINA_TEAM_MAX];  /* the generation each worker started in */
static __thread int lamina_in_team = 0;   /* this thread is running a member */
static __thread int lamina_pinned_cpu = -1;

static double lamina_team_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* Wait until *value >= target: spinning (and yielding the CPU to any thread ready to run on it)
 * for up to `spin` seconds, or while *stop stays 0 where stop is given; then asleep on the
 * pool's condition (whoever changes *value broadcasts it under the pool's lock). */
static void lamina_team_wait(const long *value, long target, double spin, const int *stop) {
    double t0 = lamina_team_seconds();
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (__atomic_load_n(value, __ATOMIC_ACQUIRE) >= target)
                return;
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        }
        if ((stop && __atomic_load_n(stop, __ATOMIC_RELAXED)) || lamina_team_seconds() - t0 >= spin)
            break;
        sched_yield();
    }
    pthread_mutex_lock(&lamina_team.lock);
    while (__atomic_load_n(value, __ATOMIC_ACQUIRE) < target)
        pthread_cond_wait(&lamina_team.wake, &lamina_team.lock);
    pthread_mutex_unlock(&lamina_team.lock);
}

/* *value += k and wake whoever sleeps on it */
static void lamina_team_add(long *value, long k) {
    pthread_mutex_lock(&lamina_team.lock);
    __atomic_add_fetch(value, k, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&lamina_team.wake);
    pthread_mutex_unlock(&lamina_team.lock);
}

static void lamina_team_count(long *value) { lamina_team_add(value, 1); }

static void lamina_team_place(int t, int nt, int lead_cpu) {
    if (lamina_team.ncpus < nt || lead_cpu < 0)
        return;
    int start = 0;
    for (int i = 0; i < lamina_team.ncpus; i++)
        if (lamina_team.cpus[i] == lead_cpu)
            start = i;
    int cpu = lamina_team.cpus[(start + t) % lamina_team.ncpus];
    if (cpu == lamina_pinned_cpu)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    lamina_pinned_cpu = sched_setaffinity(0, sizeof set, &set) == 0 ? cpu : -1;
}

static void *lamina_team_worker(void *arg) {
    int t = (int)(long)arg;
    long seen = lamina_team_born[t];
    lamina_in_team = 1;
    for (;;) {
        lamina_team_wait(&lamina_team.generation, seen + 1, lamina_team.spin, &lamina_team.rest);
        seen = __atomic_load_n(&lamina_team.generation, __ATOMIC_ACQUIRE);
        if (t < lamina_team.nt) {
            lamina_team_place(t, lamina_team.nt, lamina_team.lead_cpu);
            lamina_team.member(lamina_team.job, t, lamina_team.nt);
            lamina_team_count(&lamina_team.done);
        }
    }
    return NULL;
}

/* A child of fork has none of its parent's workers: it starts its own. */
static void lamina_team_after_fork(void) {
    pthread_mutex_init(&lamina_team.turn, NULL);
    pthread_mutex_init(&lamina_team.lock, NULL);
    pthread_cond_init(&lamina_team.wake, NULL);
    lamina_team.workers = 0;
}

static void lamina_team_init(void) {
    cpu_set_t set;
    lamina_team.ncpus = 0;
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        for (int c = 0; c < CPU_SETSIZE && lamina_team.ncpus < LAMINA_TEAM_MAX; c++)
            if (CPU_ISSET(c, &set))
                lamina_team.cpus[lamina_team.ncpus++] = c;
    pthread_atfork(NULL, NULL, lamina_team_after_fork);
}

/* Members beyond the workers that could be started run with a smaller team (nt is what each
 * member is told). */
static void lamina_team_run(int threads, lamina_member member, void *job) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (threads <= 1 || lamina_in_team) {
        member(job, 0, 1);
        return;
    }
    pthread_once(&once, lamina_team_init);
    pthread_mutex_lock(&lamina_team.turn);
    if (threads > LAMINA_TEAM_MAX)
        threads = LAMINA_TEAM_MAX;
    while (lamina_team.workers < threads - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        lamina_team_born[lamina_team.workers + 1] = lamina_team.generation;  /* (before this team's) */
        int failed = pthread_create(&thread, &attr, lamina_team_worker, (void *)(long)(lamina_team.workers + 1));
        pthread_attr_destroy(&attr);
        if (failed)
            break;
        lamina_team.workers++;
    }
    int nt = threads < lamina_team.workers + 1 ? threads : lamina_team.workers + 1;
    lamina_team.member = member;
    lamina_team.job = job;
    lamina_team.nt = nt;
    lamina_team.lead_cpu = sched_getcpu();
    lamina_team.done = 0;
    __atomic_store_n(&lamina_team.rest, 0, __ATOMIC_RELAXED);
    lamina_team_count(&lamina_team.generation);
    lamina_in_team = 1;
    member(job, 0, nt);
    lamina_in_team = 0;
    lamina_team_wait(&lamina_team.done, nt - 1, 2e-3, NULL);
    pthread_mutex_unlock(&lamina_team.turn);
}

/* The next run of items [start, *end) of a batch of n shared by a team of nt: each member takes
 * runs from the counter `next` (start 0), each run 1 / (2·nt) of what is left, so a member that
 * starts late or runs slower takes fewer, and each takes neighbouring items (faster than
 * alternating items: each thread's samples share cache lines). start >= n: nothing is left. */
static inline long lamina_claim_run(long *next, long n, int nt, long *end) {
    long start = __atomic_load_n(next, __ATOMIC_RELAXED);
    while (start < n) {
        long run = (n - start + 2 * nt - 1) / (2 * nt);
        if (__atomic_compare_exchange_n(next, &start, start + run, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *end = start + run;
            return start;
        }
    }
    return n;
}

/* A loop over the items [0, n) on a team of up to `threads`: each member claims runs of
 * neighbouring items (lamina_claim_run) and calls body(args, t, start, end) on each, t its
 * place in the team (for per-thread scratch). The kernels that run between the team's products
 * (element-wise, attention, normalization, depthwise convolution, the blocks of an OpenBLAS
 * product) run their loops here rather than in OpenMP regions: between two products on the team,
 * an OpenMP region woke a second pool of threads on the same CPUs, whose wakes and the team's
 * watching workers slowed both (an encoder's products at one request ran at 101-133 GFLOP/s on
 * two threads among OpenMP regions, 151-171 alone). One thread, or a call inside a member, runs
 * body(args, 0, 0, n) here. */
typedef void (*lamina_range_body)(void *args, int t, long start, long end);

typedef struct {
    lamina_range_body body;
    void *args;
    long n, next;
} lamina_range_job;

static void lamina_range_member(void *job, int t, int nt) {
    lamina_range_job *j = (lamina_range_job *)job;
    long start, end;
    while ((start = lamina_claim_run(&j->next, j->n, nt, &end)) < j->n)
        j->body(j->args, t, start, end);
}

static void lamina_team_for(int threads, long n, lamina_range_body body, void *args) {
    if (n <= 0)
        return;
    if (threads > n)
        threads = (int)n;
    if (threads <= 1 || lamina_in_team) {
        body(args, 0, 0, n);
        return;
    }
    lamina_range_job job = {body, args, n, 0};
    lamina_team_run(threads, lamina_range_member, &job);
}

/* Member t of nt's share of a product of m rows over panels [p0, p1): by_rows, its block of whole
 * tiles of `tile` rows and every panel; else every row and its block of the panels: rows
 * [r0, r1) and panels [q0, q1) (either may be empty). */
typedef struct { long r0, r1, q0, q1; } lamina_product_share;

static inline lamina_product_share lamina_product_share_of(int by_rows, long m, long tile, long p0, long p1, int t,
                                                           int nt) {
    lamina_product_share s = {0, m, p0, p1};
    if (by_rows) {
        const long tiles = (m + tile - 1) / tile;
        s.r0 = t * tiles / nt * tile;
        s.r1 = (t + 1) * tiles / nt * tile;
        s.r0 = s.r0 < m ? s.r0 : m;
        s.r1 = s.r1 < m ? s.r1 : m;
    } else {
        s.q0 = p0 + t * (p1 - p0) / nt;
        s.q1 = p0 + (t + 1) * (p1 - p0) / nt;
    }
    return s;
}

/* A product of m rows of a by packed panels, on a team: first each member prepares its block of
 * a's rows (rows(job, i0, i1): rounded or quantized into the product's scratch), then each multiplies its
 * share (lamina_product_share_of: whole tiles of `tile` rows, or a block of the `panels`) with
 * part(job, r0, r1, q0, q1). */
typedef struct {
    void *job;
    long m, tile, panels;
    int by_rows;
    void (*rows)(void *job, long i0, long i1);
    void (*part)(void *job, long r0, long r1, long q0, long q1);
} lamina_panels_product;

static void lamina_panels_rows_member(void *product, int t, int nt) {
    const lamina_panels_product *p = product;
    const long i0 = t * p->m / nt, i1 = (t + 1) * p->m / nt;
    if (i0 < i1)
        p->rows(p->job, i0, i1);
}

static void lamina_panels_part_member(void *product, int t, int nt) {
    const lamina_panels_product *p = product;
    const lamina_product_share sh = lamina_product_share_of(p->by_rows, p->m, p->tile, 0, p->panels, t, nt);
    if (sh.r0 < sh.r1 && sh.q0 < sh.q1)
        p->part(p->job, sh.r0, sh.r1, sh.q0, sh.q1);
}

static void lamina_panels_product_team(lamina_panels_product product, int threads) {
    lamina_team_run(threads < product.m ? threads : (int)product.m, lamina_panels_rows_member, &product);
    lamina_team_run(threads, lamina_panels_part_member, &product);
}

/* The workers stop watching for work and sleep (until the next team). */
static void lamina_team_rest(void) { __atomic_store_n(&lamina_team.rest, 1, __ATOMIC_RELAXED); }

static void lamina_team_set_spin(double seconds) { lamina_team.spin = seconds; }

#endif
