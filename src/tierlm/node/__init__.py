"""A memory node: another machine's RAM as a tier of the tiered runtime, and its cores as the
optimizer of the segments it holds (issue T).

- `server`: the node (`tierlm memory-node`), one trainer at a time;
- `client`: the trainer's side of a session (`NodeClient`);
- `auth`: the challenge-response over the shared token that admits a trainer;
- `transport`: messages over gloo point-to-point or a plain socket;
- `protocol`: the requests and the segments a session holds.

docs/guides/memory-node.md says how to run one. Nothing is imported here: `tierlm --help`
reaches node.cli's flags without importing torch.
"""
