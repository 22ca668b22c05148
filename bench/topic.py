"""The worst a topic exchange can cost one publish: the matcher's time on the dispatcher's loop.

    .venv/bin/python bench/topic.py [--reps 200] [--json FILE]

No database: this times `RoutingTable.route`, the call the AMQP broker makes for
each publish, on its own. Each case is a topic exchange with some bindings and a
routing key of 127 words (the most a 255-byte short string holds); it prints the
median and worst time per publish over --reps publishes with distinct keys.

  hash-run    one binding of 128 '#' (issue 34's probe: 156 ms per publish with
              the backtracking matcher of before)
  widest      one binding of the widest key allowed (32 words, '#' and '*'
              alternating: every pattern word is live at every key word)
  N-wild      N bindings of 32 random '*'/'#' words each (100 of them took 80 ms a
              publish with a trie walk; the bit-parallel matcher handles 64 pattern
              words per machine operation)
              (the last N is the most MAX_TOPIC_EXCHANGE_WORDS lets one exchange hold)
  N-literal   N bindings such as `w.N.#` (the common shape)

The first publish after a binding change also compiles the exchange's patterns
(compile_ms, once per change); the times per publish exclude it.

Prints a JSON document (also to --json FILE) and a SUMMARY line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from pepsi.amqp.model.exchanges import QUEUE, TOPIC, Binding, Exchange
from pepsi.amqp.model.routing import RoutingTable
from pepsi.amqp.model.topics import MAX_TOPIC_EXCHANGE_WORDS, MAX_TOPIC_WORDS


def _table(patterns: list[str]) -> RoutingTable:
    exchange = Exchange(vhost="/", name="x", type=TOPIC)
    bindings = [
        Binding(source_exchange="x", destination_kind=QUEUE, destination=f"q{i}", routing_key=p)
        for i, p in enumerate(patterns)
    ]
    return RoutingTable([exchange], bindings)


def _keys(count: int, rng: random.Random, first: str = "w") -> list[str]:
    # 127 words of one or two letters: 255 bytes at most, every key distinct.
    return [".".join([first] + [rng.choice("abcdefgh") for _ in range(126)]) for _ in range(count)]


def _time(table: RoutingTable, keys: list[str]) -> dict[str, float]:
    start = time.perf_counter()
    table.route("x", "")
    compile_ms = round((time.perf_counter() - start) * 1000, 3)
    took = []
    for key in keys:
        start = time.perf_counter()
        table.route("x", key)
        took.append((time.perf_counter() - start) * 1000)
    return {
        "compile_ms": compile_ms,
        "median_ms": round(statistics.median(took), 3),
        "max_ms": round(max(took), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200, help="publishes per case")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    rng = random.Random(34)  # noqa: S311 - reproducible keys, not secrets
    widest = ".".join("#" if i % 2 == 0 else "*" for i in range(MAX_TOPIC_WORDS))
    cases: dict[str, list[str]] = {
        "hash-run": [".".join(["#"] * 128)],
        "widest": [widest],
    }
    full = MAX_TOPIC_EXCHANGE_WORDS // (MAX_TOPIC_WORDS + 1)  # as many as an exchange takes
    for count in (10, 100, 1000, full):
        cases[f"{count}-wild"] = [
            ".".join(rng.choice("*#") for _ in range(MAX_TOPIC_WORDS)) for _ in range(count)
        ]
    cases["10000-literal"] = [f"w.{i}.#" for i in range(10_000)]
    results = {}
    for name, patterns in cases.items():
        table = _table(patterns)
        results[name] = {"bindings": len(patterns), **_time(table, _keys(args.reps, rng))}
        print(f"{name:14} {results[name]}", flush=True)
    document = {"reps": args.reps, "key_words": 127, "cases": results}
    if args.json:
        args.json.write_text(json.dumps(document, indent=2))
    print(json.dumps(document, indent=2))
    one = max(results["hash-run"]["max_ms"], results["widest"]["max_ms"])
    many = results[f"{full}-wild"]["max_ms"]
    print(
        f"SUMMARY worst per publish of 127 words: {one} ms with one binding, "
        f"{many} ms with the {full} bindings of 32 wildcards an exchange may hold"
    )


if __name__ == "__main__":
    main()
