import os, time, resource
def lamina_conv_diag(case, mode):
    from bench.conv import lamina_conv
    f = lamina_conv(case, mode)
    log = open(f"/tmp/prof/diag_{os.getpid()}_{case}_{mode}.txt", "w")
    def run():
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter(); f(); dt = time.perf_counter() - t
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        log.write("%.1f ms minflt %d vcsw %d ivcsw %d\n" % (1e3 * dt, r1.ru_minflt - r0.ru_minflt, r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw))
        log.flush()
    return run
