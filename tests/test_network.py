"""The emulated cluster: shaped links in network namespaces, and their teardown."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from distsync.config import Link, parse_link
from distsync.errors import ConfigError
from helpers import DISTSYNC, REPO, kill_tree, run_cli, run_ranks, children_of, env_of, training

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or subprocess.run(["which", "ip", "tc"], capture_output=True).returncode != 0,
    reason="emulated links need root (CAP_NET_ADMIN) and iproute2's ip and tc",
)


def our_leftovers(pid: int) -> list[str]:
    """Namespaces, links and /etc/netns folders that a distsync process `pid` created."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found = [l.split()[0] for l in ns.splitlines() if l.startswith(f"distsync-{pid}")]
    found += [l.split(":")[1].strip() for l in links.splitlines()
              if l.split(":")[1].strip().startswith((f"dsb{pid}", f"dsv{pid}"))]
    if os.path.isdir("/etc/netns"):
        found += [d for d in os.listdir("/etc/netns") if d.startswith(f"distsync-{pid}")]
    return found


def test_parse_link():
    assert parse_link("200mbit") == Link(200e6, 0.0)
    assert parse_link("1gbit,2ms") == Link(1e9, 0.002)
    assert parse_link("1.5Gbit, 300us") == Link(1.5e9, 300e-6)
    for bad, msg in [("fast", "bad --link bandwidth 'fast'"), ("100mbit,2", "bad --link latency '2'"),
                     ("1mbit,2ms,3", "expected BANDWIDTH[,LATENCY]")]:
        with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            parse_link(bad)


def _latency_probe(rank, world):
    from distsync.comm import Comm

    comm = Comm.from_env(["worker"] * world, 10.0, torch.device("cpu"), latency_s=0.05)
    comm.barrier()
    t0 = time.perf_counter()
    comm.all_reduce(torch.ones(4))
    ar = time.perf_counter() - t0
    pending = comm.all_reduce(torch.ones(4), async_op=True)
    t0 = time.perf_counter()
    pending.wait()
    ar_async = time.perf_counter() - t0
    t0 = time.perf_counter()
    if rank == 0:
        comm.send(torch.ones(4), dst=1)
    else:
        comm.recv(torch.ones(4), src=0)
    p2p = time.perf_counter() - t0
    comm.close()
    return ar, ar_async, p2p


def test_comm_layer_latency_per_message_round():
    # 2 ranks: a ring all-reduce has 2 (p - 1) = 2 rounds -> >= 0.1 s; a receive one round.
    for rank, (ar, ar_async, p2p) in enumerate(run_ranks(_latency_probe, 2)):
        assert 0.1 <= ar < 0.5 and 0.09 <= ar_async < 0.5
        if rank == 1:
            assert 0.05 <= p2p < 0.4


@needs_root
def test_100mbit_link_moves_10mb_in_0_75_to_1_5_seconds(tmp_path):
    proc = subprocess.Popen(DISTSYNC + ["linktest", "--link", "100mbit", "--workers", "2", "--sizes", "10",
                                        "--repeats", "1", "--out", str(tmp_path / "lt")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=55)
    assert proc.returncode == 0, err
    row = json.loads((tmp_path / "lt" / "linktest.json").read_text())["rows"][0]
    assert row["bytes"] == 10 * 2**20
    assert 0.75 <= row["p2p_s"] <= 1.5, row
    assert "100mbit" in out + err
    assert our_leftovers(proc.pid) == []  # torn down after success


@needs_root
def test_linktest_sets_ripples_partial_all_reduce_against_the_full_one(tmp_path):
    """4 workers behind 100 Mbit: a ring all-reduce of 1 MiB carries 2 * 3/4 MiB over each
    link, the Partial All-Reduce of 3 of them 2 * 2/3 MiB, ring and collective alike: about
    0.89 of the time where bandwidth sets it, and up to a third more for the ring's
    point-to-point messages (measured 1.12 once); direct sends the whole MiB to each of the 2
    others, 2 MiB: about 1.33."""
    proc = run_cli("linktest", "--link", "100mbit", "--workers", "4", "--sizes", "1", "--repeats", "3",
                   "--out", str(tmp_path / "lt"), timeout=58)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "lt" / "linktest.json").read_text())
    assert result["partial_group"] == 3
    row = result["rows"][0]
    assert 0.11 <= row["allreduce_s"] <= 0.3, row
    for reduce in ("ring", "collective"):
        assert 0.75 <= row[f"partial_{reduce}_vs_allreduce"] <= 1.4, row
    assert 1.15 <= row["partial_direct_vs_allreduce"] <= 1.9, row
    assert "Partial All-Reduce of 3 workers" in proc.stdout


@needs_root
def test_latency_without_netem_is_applied_in_comm_layer_and_recorded(tmp_path):
    # overlap off: each step's all-reduce starts after backward, so all of its latency shows
    proc = run_cli("train", "--link", "1gbit,5ms", "--steps", "20", "-o", "overlap=false", "--out", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    has_netem = subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "netem"], capture_output=True)
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    assert cfg["link"] == "1gbit,5ms"
    assert cfg["link_latency_mode"] == ("netem" if has_netem.returncode == 0 else "comm"), has_netem.stderr
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    # every step's all-reduce of 2 ranks pays 2 rounds of 5 ms from its start, after backward
    assert s["wall_time_s"] >= 20 * 0.010
    assert min(w["comm"] + w["wait"] for w in s["per_worker"].values()) >= 20 * 0.010, s["per_worker"]


def _start_and_wait_for_training(tmp_path, *extra):
    run = tmp_path / "run"
    proc = subprocess.Popen(DISTSYNC + ["train", "--steps", "1000000", "--workers", "2", "--on-failure", "restart",
                                        "--out", str(run), *extra],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 40
    while not training(run):
        if time.monotonic() > deadline or proc.poll() is not None:
            kill_tree(proc.pid)
            pytest.fail(f"training never started: {proc.stderr.read() if proc.poll() is not None else 'timeout'}")
        time.sleep(0.1)
    return proc


@needs_root
def test_teardown_after_a_killed_worker(tmp_path):
    proc = _start_and_wait_for_training(tmp_path, "--link", "1gbit")
    try:
        assert our_leftovers(proc.pid) != []  # the network is up while training
        victim = [p for p in children_of(proc.pid) if env_of(p).get("RANK") == "1"]
        os.kill(victim[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 1 and "worker rank 1 died (killed by SIGKILL)" in err, err
    assert our_leftovers(proc.pid) == []


@needs_root
def test_teardown_after_sigint(tmp_path):
    proc = _start_and_wait_for_training(tmp_path, "--link", "1gbit")
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert our_leftovers(proc.pid) == []


@needs_root
@pytest.mark.skipif(subprocess.run(["which", "setpriv"], capture_output=True).returncode != 0,
                    reason="needs util-linux setpriv to drop CAP_NET_ADMIN")
def test_link_without_cap_net_admin_is_a_one_line_error_and_builds_nothing(tmp_path):
    # root without CAP_NET_ADMIN, as in many containers
    proc = subprocess.Popen(["setpriv", "--bounding-set", "-net_admin"] + DISTSYNC +
                            ["train", "--link", "100mbit", "--out", str(tmp_path / "x")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=55)
    assert proc.returncode == 2, err
    err = err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "--link needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)" in err and "leave out --link" in err
    assert our_leftovers(proc.pid) == []


@needs_root
def test_slow_combines_with_link(tmp_path):
    """A slow worker behind an emulated link: on emulated 20 ms devices its steps take 80 ms,
    whatever the load. (Stretching each worker's own CPU time instead compared two processes'
    CPU under contention: in a soak, rank 0's own compute took 2.25x rank 1's unstretched one,
    and the 4x slow worker computed only 1.78x as long.)"""
    proc = run_cli("train", "--link", "1gbit", "--slow", "1:4", "--device-ms", "20", "--steps", "40",
                   "--out", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    w = json.loads((tmp_path / "r" / "summary.json").read_text())["per_worker"]
    assert w["1"]["compute"] > 3.0 * w["0"]["compute"] and w["0"]["wait"] > w["1"]["wait"], w


@needs_root
@pytest.mark.slow
def test_two_torchrun_agents_on_two_emulated_hosts_train_to_target(tmp_path):
    from distsync.runtime.network import EmulatedNetwork

    out = tmp_path / "mn"
    with EmulatedNetwork(2, parse_link("1gbit")) as net:
        port = 29400 + os.getpid() % 1000
        procs = []
        for node in range(2):
            cmd = ["ip", "netns", "exec", net.netns(node), sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"{net.host_ip(0)}:{port}", "--rdzv-id", "mn-test",
                   "--local-addr", net.host_ip(node),
                   "-m", "distsync.worker", "--workload", "digits", "--solver", "allreduce", "--out", str(out)]
            env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0")
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        try:
            outputs = [p.communicate(timeout=55)[0] for p in procs]
        finally:
            for p in procs:
                kill_tree(p.pid)
        assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
        leftovers_inside = net.leftovers()
    assert net.leftovers() == [] and leftovers_inside != []
    s = json.loads((out / "summary.json").read_text())
    assert s["workers"] == 2 and s["time_to_target_s"] is not None, s
