# What each kernel adds to a decode step, from a trace of tools/cupti_trace (start,end,stream,name; steps end with
# the LM head): per kernel of step S (default: the last full one), its end minus the latest end before it (with PDL
# and the side stream, kernels overlap: their own durations do not add up to the step), summed by kernel name; then
# the step's timeline, and every step's length. k3serve-bench-e2e's last steps weigh the limit's bytes with the host
# in the loop: pick an overlapped step by its number (after the prefill and the host-in-the-loop ones).
#   python3 tools/cupti_trace/steps.py trace.csv [S]
import csv, sys, collections
rows = []
with open(sys.argv[1]) as f:
    for r in csv.DictReader(f):
        rows.append((int(r['start']), int(r['end']), r['stream'], r['name']))
rows.sort(key=lambda r: r[1])
heads = [i for i, r in enumerate(rows) if 'LmHead' in r[3]]
print('kernels', len(rows), 'lm heads', len(heads))
def short(n):
    n = n.replace('k3::cuda::', '').replace('(anonymous namespace)::', '')
    return n.split('(')[0][:64]
S = int(sys.argv[2]) if len(sys.argv) > 2 else len(heads) - 1
for i, (a, b) in enumerate(zip(heads[:-1], heads[1:])):
    print(f'step {i + 1}: {(rows[b][1] - rows[a][1]) / 1e3:.1f} us, {b - a} kernels')
a, b = heads[S - 1], heads[S]
seg = rows[a + 1:b + 1]
t0 = rows[a][1]
add = collections.defaultdict(lambda: [0.0, 0.0, 0])
prev = t0
lines = []
for s, e, strm, name in seg:
    inc = max(0, e - prev)
    add[short(name)][0] += inc / 1e3
    add[short(name)][1] += (e - s) / 1e3
    add[short(name)][2] += 1
    lines.append(f'{(s - t0) / 1e3:8.1f} {(e - s) / 1e3:7.1f} {inc / 1e3:6.1f} {strm:>3} {short(name)}')
    prev = max(prev, e)
print('--- by kernel: added to the step (us), own duration (us), count')
for k, (inc, dur, c) in sorted(add.items(), key=lambda x: -x[1][0]):
    print(f'{inc:8.1f} {dur:8.1f} {c:4d}  {k}')
print(f'--- step {S}: start, duration, added, stream, kernel')
print('\n'.join(lines))
