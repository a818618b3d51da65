#!/usr/bin/env python3
"""`make demo`: start `quiver serve` with the three demo adapters, ask the base model and each
adapter the same question concurrently, print the four answers side by side, stop the server.

Standard library only, so it runs before the test venv exists."""
import json, os, socket, subprocess, sys, textwrap, threading, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIVER = os.path.join(ROOT, "target", "release", "quiver")
ADAPTERS = ["caps", "french", "pirate"]
QUESTION = sys.argv[1] if len(sys.argv) > 1 else "How do I make a cup of tea?"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def main():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [QUIVER, "serve", "--port", str(port), "--served-model-name", "smollm2",
            "--lora-modules", *[f"{a}={os.path.join(ROOT, 'demo', 'adapters', a)}" for a in ADAPTERS]]
    print("$", " ".join(os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in args), flush=True)
    server = subprocess.Popen(args)
    try:
        deadline = time.time() + 300
        while True:
            if server.poll() is not None:
                sys.exit(f"quiver serve exited with status {server.returncode}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                sys.exit("quiver serve did not become healthy within 300 s")
            time.sleep(0.5)
        models = [m["id"] for m in post_get(base + "/v1/models")["data"]]
        print(f"\nserved models: {', '.join(models)}")
        print(f"question (sent concurrently to all four, greedy): {QUESTION}\n")
        answers = {}

        def ask(model):
            t0 = time.time()
            r = post(base + "/v1/chat/completions", {"model": model, "max_tokens": 64, "temperature": 0,
                                                    "messages": [{"role": "user", "content": QUESTION}]})
            answers[model] = (r["choices"][0]["message"]["content"].strip(), time.time() - t0)

        threads = [threading.Thread(target=ask, args=(m,)) for m in ["smollm2", *ADAPTERS]]
        [t.start() for t in threads]
        [t.join() for t in threads]
        width = 34
        cols = [["base" if m == "smollm2" else m, *textwrap.wrap(answers[m][0], width), f"({answers[m][1]:.1f} s)"] for m in ["smollm2", *ADAPTERS]]
        rows = max(len(c) for c in cols)
        for i in range(rows):
            print(" | ".join((c[i] if i < len(c) else "").ljust(width) for c in cols))
            if i == 0:
                print("-+-".join("-" * width for _ in cols))
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def post_get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


if __name__ == "__main__":
    main()
