"""The subcommands of ``lwjax``, one module per user job.

Each module has ``add_parser(subparsers)``, which declares the job's flags and
sets ``command=_cmd_<name>`` and ``command_name``; ``_cmd_<name>(args) -> int``
builds the owning library module's config dataclass, calls the library function
and hands the result to :mod:`lwjax.tools.render` (or prints it as JSON). A
``ValueError`` is a user error: :func:`lwjax.tools.cli.main` prints it as one
line and exits with status 2.

* :mod:`~lwjax.tools.commands.layout`: buffers, buckets and shard loads of a
  model's layout, or every policy side by side.
* :mod:`~lwjax.tools.commands.routes`: which leaves go to Muon, as what matrices, and why.
* :mod:`~lwjax.tools.commands.plan`: memory, bytes inside/across hosts and Newton–Schulz per
  device for a mesh, or every mesh of a device count ranked.
* :mod:`~lwjax.tools.commands.bench`: time the optimizer step (or a training step).
* :mod:`~lwjax.tools.commands.convert`: Megatron <-> lwjax checkpoints, safetensors.
* :mod:`~lwjax.tools.commands.demo`: train the demo GPT with lwjax and a baseline.
* :mod:`~lwjax.tools.commands.launch`: N local processes of one jax.distributed job.

Building the parsers imports no jax; each ``_cmd_<name>`` imports what it needs.
"""

from lwjax.tools.commands import bench, convert, demo, launch, layout, plan, routes

COMMANDS = (layout, routes, plan, bench, convert, demo, launch)  # in the order of ``lwjax --help``
