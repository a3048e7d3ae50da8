"""Train a small GPT (flax nnx) with lwjax's layer-wise Muon on a data-parallel mesh.

    python examples/nnx_gpt.py --steps 200
    python examples/nnx_gpt.py --scan --tied --separate-qkv --size tiny

The model lives in :mod:`lwjax.tools.demo.model`; this script is the training loop a
flax nnx user writes. lwjax works on plain parameter pytrees, so the module is
split once into a static graph definition and its ``nnx.Param`` state, the loss
merges them back (``nnx.merge`` is the inverse of ``nnx.split``), and the final
parameters go back into the module with ``nnx.update``. No state is hidden
anywhere: ``params`` and ``state`` are the whole training state.

Without an accelerator it runs on 8 virtual CPU devices.
"""

from __future__ import annotations

import argparse
import dataclasses

from lwjax.tools.demo.example_args import example_parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = example_parser(
        __doc__.split("\n")[0], scan_help="stack the blocks and run them with nnx.scan"
    )
    return parser.parse_args(argv)


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    from lwjax.tools.demo.devices import local_mesh

    mesh = local_mesh(args.devices)  # first: asks for virtual CPU devices before JAX starts

    from flax import nnx

    import lwjax
    from lwjax.tools.demo.data import load_stdlib_corpus, train_batches
    from lwjax.tools.demo.model import GPT, MODEL_SIZES, lwjax_routing, make_loss_fn

    config = dataclasses.replace(
        MODEL_SIZES[args.size],
        scan_layers=args.scan,
        fused_qkv=not args.separate_qkv,
        tied_embedding=args.tied,
    )
    model = GPT(config, rngs=nnx.Rngs(args.seed))

    # Pure arrays for the optimizer; the graph definition and other state stay outside.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = lwjax.layerwise_muon(
        params,
        mesh,
        learning_rate=args.lr,
        muon=lwjax.MuonConfig(nesterov=True, extra_scale_factor=0.2),
        routing=lwjax_routing(config),  # stacked layers, tied embedding, fused QKV split
    )
    muon = [r for r in optimizer.plan.routes if r.is_muon]
    print(
        f"{len(optimizer.plan.routes)} leaves, {sum(r.num_params for r in muon)} Muon matrices "
        f"over {mesh.size} {mesh.devices.flat[0].platform} devices; routing {lwjax_routing(config)}"
    )
    state = optimizer.init(params)
    train_step = lwjax.make_train_step(make_loss_fn(graphdef, rest), optimizer)

    batches = train_batches(
        load_stdlib_corpus().train, args.batch_size, args.seq_len, seed=args.seed
    )
    losses = []
    for step in range(args.steps):
        params, state, metrics = train_step(params, state, next(batches))
        losses.append(float(metrics["loss"]))
        if step % args.log_every == 0 or step == args.steps - 1:
            grad_norm = float(metrics["grad_norm"])
            print(f"step {step:5d}  loss {losses[-1]:.4f}  grad norm {grad_norm:.3f}")

    nnx.update(model, params)  # the trained weights, back in the module
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
