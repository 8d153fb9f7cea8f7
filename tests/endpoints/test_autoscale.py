"""The endpoint autoscaling policies (app/endpoints/autoscale.py), on made-up load: pure."""

from __future__ import annotations

from app.endpoints.autoscale import Bounds, Kpa, QpsPolicy, Sample, StaticPeak, policy

B = Bounds(0, 8)


def run(p, load, current=0, tick=2.0, until=None):
    """Drive `p` with load(t) -> (concurrency, rps, p95) every `tick` s; the targets."""
    samples, out, t = [], [], 0.0
    end = until if until is not None else 600.0
    while t <= end:
        c, rps, p95 = load(t)
        samples.append(Sample(t, c, rps, p95))
        d = p.decide(t, samples, current)
        current = d.target
        out.append((t, d.target, d.mode))
        t += tick
    return out


def at(out, t):
    return next(n for s, n, _ in out if s >= t)


def test_static_peak_is_always_the_maximum():
    assert run(StaticPeak(B), lambda t: (0, 0, None), until=10)[-1][1] == 8


def test_kpa_scales_from_zero_at_once_up_with_a_burst_and_back_to_zero_after_a_window():
    def load(t):  # quiet, 4 in flight, a burst of 24, quiet again
        if t < 20:
            return 0, 0, None
        if t < 200:
            return 4, 8, 100
        if t < 240:
            return 24, 50, 300
        if t < 400:
            return 4, 8, 100
        return 0, 0, None

    out = run(Kpa(B, target_concurrency=2), load)
    assert at(out, 0) == 0
    assert at(out, 20) >= 1  # the first request: up from zero in the same tick
    assert at(out, 150) == 2  # 4 in flight / 2 each
    burst = [n for s, n, m in out if 200 <= s < 240]
    assert max(burst) == 8 and any(m == "panic" for s, _, m in out if 200 <= s < 240)
    assert at(out, 204) >= 6  # panic: within a couple of ticks, not a stable window
    assert at(out, 239) == 8  # no scale down while the burst lasts
    assert at(out, 380) == 2  # back down after it
    assert at(out, 600) == 0  # and to zero after a quiet stable window


def test_kpa_adds_replicas_when_the_slo_is_missed():
    out = run(Kpa(B, target_concurrency=4, slo_p95_ms=200), lambda t: (4, 8, 450), current=1)
    assert at(out, 10) >= 3  # 450 / 200 ms: more than twice the replicas


def test_qps_waits_its_delays_before_moving():
    p = QpsPolicy(B, target_qps_per_replica=5, upscale_delay_s=30, downscale_delay_s=60)

    def load(t):
        return (0, 20, None) if t < 100 else (0, 5, None)

    out = run(p, load, current=1, until=300)
    assert at(out, 20) == 1  # not yet: 30 s of wanting more first
    assert at(out, 40) == 4  # 20 rps / 5
    assert at(out, 140) == 4  # the window still averages the old load, then the delay
    assert at(out, 300) == 1
    assert policy("qps", B, target_qps_per_replica=1).name == "qps"


def test_kpa_remembers_little_and_decides_the_same_after_recalling_it():
    """The controller keeps a Kpa's memory on the endpoint between ticks: a Kpa rebuilt from
    it each tick decides as one kept alive, and an endpoint at rest remembers nothing."""
    bounds = Bounds(0, 10)
    kept = Kpa(bounds, 2.0, scale_down_delay_s=30)
    memory: dict = {}
    load = [6.0] * 20 + [1.0] * 40 + [0.0] * 100
    samples: list[Sample] = []
    current = 0
    for t, c in enumerate(load):
        samples.append(Sample(float(t), c, c))
        a = kept.decide(float(t), samples, current)
        rebuilt = Kpa(bounds, 2.0, scale_down_delay_s=30).recall(memory)
        b = rebuilt.decide(float(t), samples, current)
        memory = rebuilt.memory
        assert (a.target, a.mode) == (b.target, b.mode), t
        assert len(memory.get("wanted", [])) <= 3
        current = a.target
    assert current == 0 and memory == {}
