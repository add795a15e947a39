"""`anchorkv demo` (also `python -m anchorkv.demo`): one Kimi-Linear request's cache state
through every codec, verified; then a save -> new process -> restore cycle through the store.

- `fields`: builds the regions vLLM 0.33 would allocate for Kimi-Linear-48B-A3B on one rank,
  fills one request's blocks with realistic data, packs every field with each codec, unpacks
  into other block ids of the same regions (as after a restart) and checks the result (raw:
  identical bytes; lossy: SQNR) and that no other byte changed.
- `cycle`: saves through the connector's worker path into a store, restores in a new process
  (`python -m anchorkv.demo.cycle`) into other blocks, verifies.
- `cli`: the command (`register`, `main`), its tables and its `--json` object.

The regions and fills come from `anchorkv.testing.regions`, the SQNR from
`anchorkv.testing.metrics`.
"""
