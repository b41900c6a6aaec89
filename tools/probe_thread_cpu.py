# Per-thread CPU use, user and system time apart, of every process whose command line contains
# a pattern: once a second, each thread above 10 % of a core, as pid/tid:name=u<user %>+s<system %>.
# Shows whether a progress thread is saturated and where its time goes (a thread in socket calls
# is mostly system time). E.g. beside a running probe:
#   python3 tools/probe_thread_cpu.py probe_exchange_patterns 60
import os
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pattern):
    """(pid, tid, name) -> (user, system) clock ticks of each thread of the matching processes."""
    ticks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                command = f.read()
            if pattern not in command or __file__ in command:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                ticks[(pid, tid, name)] = (int(fields[11]), int(fields[12]))
        except OSError:  # the process or thread ended meanwhile
            continue
    return ticks


def main():
    pattern, seconds = sys.argv[1], float(sys.argv[2])
    end = time.monotonic() + seconds
    before, then = cpu_ticks(pattern), time.monotonic()
    while time.monotonic() < end:
        time.sleep(1.0)
        after, now = cpu_ticks(pattern), time.monotonic()
        shown = []
        for key, (user, system) in sorted(after.items()):
            user0, system0 = before.get(key, (user, system))
            scale = 100 / TICKS / (now - then)
            u, s = (user - user0) * scale, (system - system0) * scale
            if u + s >= 10:
                shown.append(f"{key[0]}/{key[1]}:{key[2]}=u{u:.0f}+s{s:.0f}")
        print(time.strftime("%H:%M:%S"), " ".join(shown), flush=True)
        before, then = after, now


if __name__ == "__main__":
    main()
