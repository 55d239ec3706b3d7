"""Train a model with N local ``swarm-stage`` processes and no leader.

Writes one plan per stage, starts the processes, and prints the last stage's progress.
With ``--transport tunnel`` (or ``auto``) it needs a NATS server: pass ``--nats-url`` or let
it start one on a free port.

    python exp/scripts/local_pipeline.py --stages 3 --steps 50
    python exp/scripts/local_pipeline.py --stages 2 --transport tunnel --compression fixed_int8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from silentswarm.agent.runtime.launch import done, links, run_plans  # noqa: E402
from silentswarm.natsd import NatsServer, start_nats_server  # noqa: E402
from silentswarm.plan import ModelConfig, TrainConfig, Transport, chain_plans  # noqa: E402
from silentswarm.procs import free_port  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--compression", default="none")
    parser.add_argument("--transport", choices=[t.value for t in Transport], default="p2p")
    parser.add_argument("--nats-url", default=None)
    parser.add_argument("--data", nargs="*", default=["stdlib"], help="paths or globs")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="swarm-local-"))
    nats: NatsServer | None = None
    url = args.nats_url
    if url is None and args.transport != "p2p":
        nats = start_nats_server(
            host="127.0.0.1",
            port=0,
            store_dir=work / "nats",
            log_path=work / "nats.log",
            tie_to_parent=True,
        )
        url = nats.url
    try:
        plans = chain_plans(
            job_id="local",
            model=ModelConfig(n_layers=args.layers, d_model=args.d_model, n_heads=4, seq_len=64),
            train=TrainConfig(steps=args.steps, batch_size=8, micro_batches=4, data=args.data),
            addresses=[None] + [f"tcp://127.0.0.1:{free_port()}" for _ in range(args.stages - 1)],
            compression=args.compression,
            transport=Transport(args.transport),
            nats_url=url,
            intra_op_threads=1,
        )
        print(f"{args.stages} stages, plans and logs in {work}", flush=True)
        every = max(1, args.steps // 10)
        last_stage = args.stages - 1

        def progress(event: dict) -> None:
            if event.get("stage") != last_stage:
                return
            if event["event"] == "links" and event["up"]:
                print(f"boundary into the last stage: {event['up']}", flush=True)
            elif event["event"] == "step" and event["step"] % every == 0:
                print(
                    f"step {event['step']:5d}/{args.steps}  loss {event['loss']:.4f}  "
                    f"{event['tokens_per_s']:8.0f} tok/s",
                    flush=True,
                )

        results = run_plans(plans, work, on_event=progress)
    finally:
        if nats is not None:
            nats.stop()
    summary = done(results[-1])
    print(f"links: {[(links(r)['up'], links(r)['down']) for r in results]}")
    print(f"final loss {summary['loss']:.4f}, validation loss {summary['val_loss']:.4f}")


if __name__ == "__main__":
    main()
