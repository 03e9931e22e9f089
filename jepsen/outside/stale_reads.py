#!/usr/bin/env python3
"""Issue 12's scenario by hand, with a client that shares no code with the router.

Three `kvrouter-ha serve` replicas with their default consistency flags (bounded, 1 s), three
simulated workers, and HAProxy running deploy/haproxy.cfg in front, all on one loopback address.
For the leader and then for a follower: bind 30 sessions through HAProxy, SIGSTOP the replica,
rebind every session to another worker through the running leader (admin DELETE, then a request
with X-Target-Worker), send one request per session straight to the stopped replica (it queues in
the kernel), keep it stopped 10 s in all, SIGCONT it and at once send another request per session
straight to it. Every answer is compared with the rebind's binding: an older revision is a stale
read. Prints a table; exits 1 if any answer carried an old binding.

    go build -o /tmp/kvrouter-ha ./cmd/kvrouter-ha
    python3 jepsen/outside/stale_reads.py /tmp/kvrouter-ha

Only the Python standard library; every process it starts it stops by its pid.
"""

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HOST = "127.0.77.1"
SESSIONS = 30
PAUSE = 10.0


def port(base, i):
    return f"{HOST}:{base + i}"


def request(addr, method, path, body=None, headers=None, timeout=60):
    """One HTTP request; returns (status, headers, body) or raises."""
    host, p = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(p), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


def chat(addr, session, text, target=None):
    body = json.dumps({"model": "sim-model", "max_tokens": 2,
                       "messages": [{"role": "user", "content": text}]})
    headers = {"Content-Type": "application/json", "X-Session-ID": session}
    if target:
        headers["X-Target-Worker"] = target
    sent = time.monotonic()
    status, hdrs, _ = request(addr, "POST", "/v1/chat/completions", body, headers)
    return {"status": status, "worker": hdrs.get("x-kvrouter-worker"),
            "revision": int(hdrs.get("x-kvrouter-binding-revision") or 0),
            "sent": sent, "answered": time.monotonic()}


def wait(cond, within, what):
    deadline = time.monotonic() + within
    while True:
        try:
            if cond():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


class Cluster:
    def __init__(self, binary, root):
        self.binary, self.root, self.procs = binary, root, {}
        self.workers = [f"w{i}" for i in range(3)]
        self.replicas = [f"r{i}" for i in range(3)]

    def start(self, name, argv, env=None):
        log = open(os.path.join(self.root, name + ".log"), "ab")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=log, env=env)

    def up(self):
        specs = ",".join(f"w{i}=http://{port(9100, i)}" for i in range(3))
        for i, w in enumerate(self.workers):
            self.start(w, [self.binary, "sim-worker", "--id", w, "--listen", port(9100, i),
                           "--log-level", "warn"])
        peers = ",".join(port(7010, i) for i in range(3))
        gossip = ",".join(port(7020, i) for i in range(3))
        for i, r in enumerate(self.replicas):
            self.start(r, [self.binary, "serve", "--replica-id", r,
                           "--listen", port(8080, i), "--admin-listen", port(9090, i),
                           "--raft-listen", port(7000, i), "--peer-listen", port(7010, i),
                           "--gossip-listen", port(7020, i), "--join", peers, "--gossip-join", gossip,
                           "--bootstrap-expect", "3", "--data-dir", os.path.join(self.root, r),
                           "--worker", specs, "--log-level", "info"])
        env = dict(os.environ, KVR_LISTEN=port(8000, 0),
                   **{f"KVR_REPLICA{i}": port(8080, i) for i in range(3)})
        cfg = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy", "haproxy.cfg")
        self.start("haproxy", ["haproxy", "-db", "-f", cfg], env=env)
        for i in range(3):
            wait(lambda: request(port(8080, i), "GET", "/readyz", timeout=2)[0] == 200, 60, f"r{i} ready")
        wait(lambda: self.lb_up(), 30, "HAProxy to see every replica up")

    def lb_up(self):
        # Every replica answers through the balancer: ask it a few times.
        return all(request(port(8000, 0), "GET", "/readyz", timeout=2)[0] == 200 for _ in range(6))

    def down(self):
        for p in self.procs.values():
            try:
                p.send_signal(signal.SIGCONT)
                p.kill()
            except ProcessLookupError:
                pass
            p.wait()

    def status(self, i):
        s, _, body = request(port(9090, i), "GET", "/admin/cluster", timeout=3)
        return json.loads(body) if s == 200 else None

    def leader(self, among=range(3)):
        for i in among:
            try:
                st = self.status(i)
            except OSError:
                continue
            if st and st["self"]["state"] == "Leader":
                return i
        return None


def run(c, stop_leader, tag):
    lb = port(8000, 0)
    sessions = [f"{tag}-{n}" for n in range(SESSIONS)]
    before = {}
    for s in sessions:
        a = chat(lb, s, "first turn of " + s)
        assert a["status"] == 200 and a["revision"], a
        before[s] = a
    leader = None
    wait(lambda: c.leader() is not None, 30, "a leader")
    leader = c.leader()
    victim = leader if stop_leader else next(i for i in range(3) if i != leader)
    proc = c.procs[c.replicas[victim]]
    # Every replica has applied every binding: what the victim holds is the old state.
    wait(lambda: all(c.status(i)["bindings"] >= len(before) for i in range(3)), 30, "bindings everywhere")
    proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    others = [i for i in range(3) if i != victim]
    wait(lambda: c.leader(others) is not None, 30, "a leader among the others")
    live = c.leader(others)
    after = {}
    for s in sessions:
        s_, _, body = request(port(9090, live), "DELETE", f"/admin/sessions/{s}", timeout=5)
        assert s_ == 200, (s_, body)
        to = next(w for w in c.workers if w != before[s]["worker"])
        a = chat(port(8080, live), s, "rebound turn of " + s, target=to)
        assert a["status"] == 200 and a["worker"] == to and a["revision"] > before[s]["revision"], a
        after[s] = a
    last_ack = max(a["answered"] for a in after.values())
    results = []
    lock = threading.Lock()

    def ask(s, when):
        try:
            a = chat(port(8080, victim), s, f"{when} turn of {s}")
        except OSError as e:
            a = {"status": 0, "error": str(e), "worker": None, "revision": 0}
        with lock:
            results.append((s, when, a))

    time.sleep(max(0.0, last_ack + 1.5 - time.monotonic()))  # past the 1 s bound
    threads = [threading.Thread(target=ask, args=(s, "queued before")) for s in sessions]
    for t in threads:
        t.start()
    time.sleep(max(0.0, stopped_at + PAUSE - time.monotonic()))
    proc.send_signal(signal.SIGCONT)
    resumed = time.monotonic()
    late = [threading.Thread(target=ask, args=(s, "sent after")) for s in sessions]
    for t in late:
        t.start()
    for t in threads + late:
        t.join()
    counts = {}
    worst = []
    for s, when, a in results:
        if a["status"] != 200:
            kind = f"status {a['status']}"
        elif a["revision"] < after[s]["revision"]:
            kind = "OLD binding"
            worst.append((s, when, a, after[s]))
        else:
            kind = "new binding"
        counts[(when, kind)] = counts.get((when, kind), 0) + 1
    role = "leader" if stop_leader else "follower"
    for (when, kind), n in sorted(counts.items()):
        lat = [a["answered"] - resumed for s, w, a in results if w == when]
        print(f"  {role:8} r{victim}  requests {when:13} SIGCONT: {kind:12} {n:3} of {SESSIONS}"
              f"   (answered {min(lat)*1000:.0f}-{max(lat)*1000:.0f} ms after SIGCONT)")
    for s, when, a, want in worst[:3]:
        print(f"    e.g. {s} ({when}): {a['worker']} rev {a['revision']}, rebound to {want['worker']} rev {want['revision']}")
    wait(lambda: all(request(port(8080, i), "GET", "/readyz", timeout=2)[0] == 200 for i in range(3)), 60, "all ready")
    wait(c.lb_up, 30, "HAProxy to see every replica up")
    return len(worst)


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    binary = os.path.abspath(sys.argv[1])
    if not shutil.which("haproxy"):
        raise SystemExit("haproxy is not on PATH (apt-get install haproxy)")
    root = tempfile.mkdtemp(prefix="kvr-stale-")
    c = Cluster(binary, root)
    old = 0
    try:
        c.up()
        print(f"three replicas behind HAProxy (deploy/haproxy.cfg) on {HOST}, {SESSIONS} sessions, {PAUSE:.0f} s SIGSTOP")
        old += run(c, True, "lead")
        old += run(c, False, "foll")
    finally:
        c.down()
        shutil.rmtree(root, ignore_errors=True)
    print(f"answers with a binding older than the rebind: {old}")
    sys.exit(1 if old else 0)


if __name__ == "__main__":
    main()
