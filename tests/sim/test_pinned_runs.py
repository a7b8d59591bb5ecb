"""Runs pinned to what the simulator gave before its speed work: makespans and a digest of every per-vertex
array of a run, over compiled LLaMA plans (prefill on 1, 2 and 4 GPUs with offloads, a LoRA step) and random
DAGs, every policy, several profiles (host caps and spreads, a power bucket, the calibrated shared clock).

A change that alters one number of one run changes its digest. To regenerate after an intended change of the
simulator's model or of the plans the compiler builds (never for a speed change): ``python
tests/sim/test_pinned_runs.py`` prints the table.

numpy's ``exp`` and ``log`` give last-bit differences between its AVX-512 and AVX2 code paths, chosen by the CPU at
run time; they move a run's host and link factors (and may move a duration by a nanosecond), not the model. The
runs are therefore computed in a subprocess with numpy's AVX-512 paths off (``NPY_DISABLE_CPU_FEATURES``, the paths
the pins were made on), so the pins hold on any x86-64 machine with AVX2."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sim import TimingModel, fastest_run, simulate
from turnip.machine.profile import HOST_TOTALS, h100, load_profile
from turnip.memgraph.build import build_memgraph
from turnip.models import llama_prefill, random_dag
from turnip.sched import POLICIES

pytestmark = pytest.mark.sim


@pytest.fixture(autouse=True)
def _ungrouped(monkeypatch):
    """The pins are of runs without launch groups (``turnip.sched.groups``, on by default for several GPUs since):
    ``tests/sched/test_groups.py`` covers grouped runs."""
    monkeypatch.setenv("TURNIP_LAUNCH_GROUPS", "0")

FIELDS = ("issue_ns", "start_ns", "end_ns", "done_ns", "stream", "host_start_ns", "handle_ns", "order")
PROFILES = {
    "h100": lambda: h100(),
    "spread": lambda: h100().replace(link_excess_sd=0.1, host_excess_sd=0.2),
    "no caps": lambda: h100().replace(**dict.fromkeys(HOST_TOTALS, ())),
    "duty": lambda: h100().replace(power_duty=0.7),
    "calibrated": lambda: load_profile("h100-calibrated"),
}


def plan(name: str):
    if name.startswith("tiny"):
        _, seq, gpus, budget = name.split("/")
        return build_memgraph(llama_prefill("tiny", int(seq), int(gpus)), int(budget) << 10)
    if name == "lora":
        from turnip.compile import compile_model
        from turnip.train import TrainSpec

        return compile_model("llama-tiny", 16, 1, 96 << 10, train=TrainSpec(2), fold=False)[1]  # as pinned
    seed = int(name.split("/")[1])
    return build_memgraph(random_dag(np.random.default_rng(seed), n_kernels=60, n_gpus=1 + seed % 4), 12 << 10)


PLANS = ("tiny/64/1/32", "tiny/256/1/64", "tiny/64/2/32", "tiny/128/4/48", "lora", "dag/2", "dag/3")


def digest(r) -> str:
    """Every per-vertex array of run ``r``, its bound and its host and link factors, hashed."""
    h = hashlib.sha256()
    for f in FIELDS:
        h.update(np.ascontiguousarray(getattr(r, f), dtype=np.int64).tobytes())
    h.update(json.dumps(r.bound, sort_keys=True, default=str).encode())
    h.update(repr((r.host_factor, r.link_factor)).encode())
    return h.hexdigest()


def runs(name: str, prof_name: str) -> tuple[int, str, list[int]]:
    """Vertices, one digest of every run and the makespans (every policy: seeds 0 and 1, then seed 0 with
    means only), for one plan and profile."""
    mg, prof = plan(name), PROFILES[prof_name]()
    tm = TimingModel(mg, prof)
    order = fastest_run(mg, prof, range(2), False, tm).order
    makespans, h = [], hashlib.sha256()
    for policy in POLICIES:
        for seed, mean_only in ((0, False), (1, False), (0, True)):
            o = order if policy == "det-replay" else None
            r = simulate(mg, prof, policy, seed, mean_only, tm, o)
            makespans.append(int(r.makespan_ns))
            h.update(digest(r).encode())
    return mg.n, h.hexdigest()[:16], makespans


# fmt: off
PINNED: dict[tuple[str, str], tuple] = {
    ('tiny/64/1/32', 'h100'): (444, 'ca86f67957474671', [
        10519365, 10657961, 10574630, 10401179, 10539706, 10453682, 12429517, 12568418,
        12505127, 11016923, 11155238, 11076963, 10519365, 10657961, 10574630]),
    ('tiny/64/1/32', 'spread'): (444, 'e874186e90e3e7ef', [
        9049058, 11878906, 10574630, 8932392, 11697833, 10453682, 10768100, 13876447,
        12505127, 9492449, 12363824, 11076963, 9049058, 11863256, 10574630]),
    ('tiny/64/1/32', 'no caps'): (444, 'ca86f67957474671', [
        10519365, 10657961, 10574630, 10401179, 10539706, 10453682, 12429517, 12568418,
        12505127, 11016923, 11155238, 11076963, 10519365, 10657961, 10574630]),
    ('tiny/64/1/32', 'duty'): (444, 'ca86f67957474671', [
        10519365, 10657961, 10574630, 10401179, 10539706, 10453682, 12429517, 12568418,
        12505127, 11016923, 11155238, 11076963, 10519365, 10657961, 10574630]),
    ('tiny/64/1/32', 'calibrated'): (444, '6907a7e3aa102eaf', [
        7090752, 7406537, 7548443, 6980661, 7306520, 7452249, 8034328, 8369963,
        8551805, 7358981, 7647321, 7799194, 7090752, 7408321, 7550020]),
    ('tiny/256/1/64', 'h100'): (622, 'c73f87e67db73e44', [
        16749263, 16749266, 16863396, 16611345, 16611071, 16722133, 19295757, 19294958,
        19435258, 16990793, 16990530, 17107220, 16749263, 16749266, 16863396]),
    ('tiny/256/1/64', 'spread'): (622, '76bcab569d7e7f51', [
        14326577, 13578979, 16863396, 14192465, 13446508, 16722133, 16574593, 15732891,
        19435258, 14535787, 13777485, 17107220, 14326577, 13578979, 16863396]),
    ('tiny/256/1/64', 'no caps'): (622, 'c73f87e67db73e44', [
        16749263, 16749266, 16863396, 16611345, 16611071, 16722133, 19295757, 19294958,
        19435258, 16990793, 16990530, 17107220, 16749263, 16749266, 16863396]),
    ('tiny/256/1/64', 'duty'): (622, 'c73f87e67db73e44', [
        16749263, 16749266, 16863396, 16611345, 16611071, 16722133, 19295757, 19294958,
        19435258, 16990793, 16990530, 17107220, 16749263, 16749266, 16863396]),
    ('tiny/256/1/64', 'calibrated'): (622, '945967c5b1d43739', [
        11479082, 13562796, 11607464, 11385155, 13451466, 11511039, 12917202, 15160768,
        13091085, 11677310, 13775834, 11810576, 11479082, 13578252, 11607464]),
    ('tiny/64/2/32', 'h100'): (358, 'fad1166d20c8e5d9', [
        6144503, 6085701, 6093193, 6019978, 6012910, 6017895, 6933652, 6719836,
        6740424, 6491354, 6323947, 6338203, 6129272, 6085701, 6093193]),
    ('tiny/64/2/32', 'spread'): (358, '4abc471ffebf320e', [
        6319885, 6032359, 6093193, 6193803, 5959284, 6017895, 7123811, 6664971,
        6740424, 6676668, 6270309, 6338203, 6303457, 6032359, 6093193]),
    ('tiny/64/2/32', 'no caps'): (358, 'fad1166d20c8e5d9', [
        6144503, 6085701, 6093193, 6019978, 6012910, 6017895, 6933652, 6719836,
        6740424, 6491354, 6323947, 6338203, 6129272, 6085701, 6093193]),
    ('tiny/64/2/32', 'duty'): (358, 'fad1166d20c8e5d9', [
        6144503, 6085701, 6093193, 6019978, 6012910, 6017895, 6933652, 6719836,
        6740424, 6491354, 6323947, 6338203, 6129272, 6085701, 6093193]),
    ('tiny/64/2/32', 'calibrated'): (358, 'f612961ddd841e47', [
        4444063, 5424573, 5036173, 4387557, 5369901, 4981545, 4772309, 5712866,
        5324122, 4513172, 5452836, 5073640, 4444063, 5424573, 5036173]),
    ('tiny/128/4/48', 'h100'): (392, '918a444aa7bed0fd', [
        6467832, 6468499, 6473577, 6435396, 6435839, 6439893, 6802178, 6804664,
        6816572, 6545281, 6545120, 6551783, 6467832, 6468499, 6473577]),
    ('tiny/128/4/48', 'spread'): (392, '52c41f50f7826c36', [
        6951014, 8529283, 6473577, 6940548, 8535498, 6439893, 7335652, 8934760,
        6816572, 7032362, 8650688, 6551783, 6951014, 8527001, 6452517]),
    ('tiny/128/4/48', 'no caps'): (392, '918a444aa7bed0fd', [
        6467832, 6468499, 6473577, 6435396, 6435839, 6439893, 6802178, 6804664,
        6816572, 6545281, 6545120, 6551783, 6467832, 6468499, 6473577]),
    ('tiny/128/4/48', 'duty'): (392, '918a444aa7bed0fd', [
        6467832, 6468499, 6473577, 6435396, 6435839, 6439893, 6802178, 6804664,
        6816572, 6545281, 6545120, 6551783, 6467832, 6468499, 6473577]),
    ('tiny/128/4/48', 'calibrated'): (392, 'ee8b26b6fbd1fa6f', [
        7975532, 4567867, 5515032, 8023174, 4551291, 5496714, 8110570, 4714499,
        5661170, 8036082, 4575123, 5522735, 7975532, 4567867, 5515032]),
    ('lora', 'h100'): (1859, '3d6e491ce0e6ece1', [
        33353195, 33191264, 33067330, 32572521, 32391501, 32251505, 46136911, 46025496,
        45941543, 35390133, 35199804, 35110713, 33394291, 33191264, 33085249]),
    ('lora', 'spread'): (1859, 'ef67c10c2f704c89', [
        34205877, 40406939, 33067330, 33430559, 39549494, 32251505, 47170609, 55069233,
        45941543, 36262767, 42958891, 35110713, 34205877, 40431743, 33054330]),
    ('lora', 'no caps'): (1859, '3d6e491ce0e6ece1', [
        33353195, 33191264, 33067330, 32572521, 32391501, 32251505, 46136911, 46025496,
        45941543, 35390133, 35199804, 35110713, 33394291, 33191264, 33085249]),
    ('lora', 'duty'): (1859, '3d6e491ce0e6ece1', [
        33353195, 33191264, 33067330, 32572521, 32391501, 32251505, 46136911, 46025496,
        45941543, 35390133, 35199804, 35110713, 33394291, 33191264, 33085249]),
    ('lora', 'calibrated'): (1859, 'c81512109db66b06', [
        26007971, 31261462, 29047576, 25766664, 31069507, 28834129, 32513685, 38040552,
        35747444, 27572770, 32812369, 30557863, 26007971, 31319288, 29050707]),
    ('dag/2', 'h100'): (215, 'bc7bb11df86c7f12', [
        2811467, 2811090, 2817851, 2835604, 2834488, 2840248, 3486642, 3486209,
        3508579, 2888983, 2889814, 2897919, 2811467, 2811090, 2817851]),
    ('dag/2', 'spread'): (215, 'a700db40760cb848', [
        3106931, 2964893, 2817851, 3137728, 2991769, 2840248, 3795002, 3646695,
        3508579, 3184888, 3043840, 2897919, 3106931, 2964893, 2817851]),
    ('dag/2', 'no caps'): (215, 'bc7bb11df86c7f12', [
        2811467, 2811090, 2817851, 2835604, 2834488, 2840248, 3486642, 3486209,
        3508579, 2888983, 2889814, 2897919, 2811467, 2811090, 2817851]),
    ('dag/2', 'duty'): (215, 'bc7bb11df86c7f12', [
        2811467, 2811090, 2817851, 2835604, 2834488, 2840248, 3486642, 3486209,
        3508579, 2888983, 2889814, 2897919, 2811467, 2811090, 2817851]),
    ('dag/2', 'calibrated'): (215, '658178ab8a6abbec', [
        3676462, 2924558, 2901921, 3646131, 2900903, 2878331, 3876429, 3164201,
        3155480, 3685277, 2939112, 2917523, 3676462, 2924558, 2901921]),
    ('dag/3', 'h100'): (217, 'b61d00b6cb18a24a', [
        2886462, 2885854, 2891938, 2893484, 2893082, 2899395, 3391152, 3390162,
        3408531, 2949748, 2949191, 2956582, 2886462, 2885854, 2891938]),
    ('dag/3', 'spread'): (217, '66f0fc4628279515', [
        3471115, 3211902, 2891938, 3475983, 3217933, 2899395, 3990839, 3723974,
        3408531, 3535103, 3275660, 2956582, 3471115, 3211902, 2891938]),
    ('dag/3', 'no caps'): (217, 'b61d00b6cb18a24a', [
        2886462, 2885854, 2891938, 2893484, 2893082, 2899395, 3391152, 3390162,
        3408531, 2949748, 2949191, 2956582, 2886462, 2885854, 2891938]),
    ('dag/3', 'duty'): (217, 'b61d00b6cb18a24a', [
        2886462, 2885854, 2891938, 2893484, 2893082, 2899395, 3391152, 3390162,
        3408531, 2949748, 2949191, 2956582, 2886462, 2885854, 2891938]),
    ('dag/3', 'calibrated'): (217, 'ec4a9fc2b7a3bc38', [
        2957707, 3281836, 2979477, 2954728, 3278519, 2976477, 3127918, 3440141,
        3159001, 2945921, 3263786, 2968206, 2957707, 3281836, 2979477]),
}
# fmt: on


def pinned_simd_env() -> dict:
    """The environment of the subprocess: numpy's AVX-512 dispatch targets that this CPU has, turned off."""
    found = getattr(np, "__config__", None) and np.__config__.CONFIG.get("SIMD Extensions", {}).get("found", [])
    off = [f for f in found or [] if "AVX512" in f or f == "X86_V4"]
    return dict(os.environ, NPY_DISABLE_CPU_FEATURES=" ".join(off), TURNIP_LAUNCH_GROUPS="0")


@pytest.fixture(scope="module")
def computed() -> dict:
    """Every pinned key's ``runs``, computed in one subprocess with numpy's AVX-512 paths off."""
    root = Path(__file__).resolve().parents[2]
    env = pinned_simd_env()
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, __file__, "--json"], env=env, cwd=root, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return {tuple(k.split("|")): (v[0], v[1], v[2]) for k, v in json.loads(p.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("key", sorted(PINNED), ids=lambda k: "-".join(k))
def test_runs_are_those_pinned(key, computed):
    assert computed[key] == PINNED[key]


if __name__ == "__main__" and sys.argv[1:] == ["--json"]:  # the fixture's subprocess
    print(json.dumps({"|".join(k): runs(*k) for k in sorted(PINNED)}))
elif __name__ == "__main__" and "NPY_DISABLE_CPU_FEATURES" not in os.environ:  # the table, made as the pins are
    raise SystemExit(subprocess.run([sys.executable, __file__], env=pinned_simd_env()).returncode)
elif __name__ == "__main__":
    print("# fmt: off\nPINNED: dict[tuple[str, str], tuple] = {")
    for name in PLANS:
        for prof_name in PROFILES:
            n, dg, ms = runs(name, prof_name)
            print(f"    {(name, prof_name)!r}: ({n}, {dg!r}, [\n        {', '.join(map(str, ms[:8]))},")
            print(f"        {', '.join(map(str, ms[8:]))}]),")
    print("}\n# fmt: on")
