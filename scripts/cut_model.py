#!/usr/bin/env python3
"""Writes a GGUF model cut to its first layers: every kept tensor byte-identical, the block count
lowered, the tokenizer and all other metadata intact. A shallower copy of a real model for tests
that cannot afford all its layers (the GPU carry's 64 MiB, the CPU emulation of the CUDA tests).

  cut_model.py SRC DST --layers N        the first N layers (all if the model has fewer)
  cut_model.py SRC DST --budget-kib K    as many layers as fit K KiB
"""
import argparse
import re
import sys

import gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    size = ap.add_mutually_exclusive_group(required=True)
    size.add_argument("--layers", type=int)
    size.add_argument("--budget-kib", type=float)
    a = ap.parse_args()

    r = gguf.GGUFReader(a.src)
    arch = r.fields["general.architecture"].contents()
    n_layer = r.fields[f"{arch}.block_count"].contents()
    layer_of = lambda t: int(m.group(1)) if (m := re.match(r"blk\.(\d+)\.", t.name)) else None
    if a.layers is not None:
        keep = min(n_layer, a.layers)
    else:
        meta = min(t.data_offset for t in r.tensors)  # header, metadata and tensor infos
        shared = meta + sum(t.n_bytes for t in r.tensors if layer_of(t) is None)
        per_layer = sum(t.n_bytes for t in r.tensors if layer_of(t) == 0)
        keep = min(n_layer, int((a.budget_kib * 2**10 - shared) // per_layer))
    if keep < 1:
        sys.exit(f"{a.src}: not even one layer fits")

    w = gguf.GGUFWriter(a.dst, arch=arch, endianess=r.endianess)
    for f in r.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        val = keep if f.name == f"{arch}.block_count" else f.contents()
        w.add_key_value(f.name, val, vtype, sub_type=sub)
    tensors = [t for t in r.tensors if layer_of(t) is None or layer_of(t) < keep]
    for t in tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors:
        w.write_tensor_data(t.data, tensor_endianess=r.endianess)
    w.close()
    print(f"model: {a.src} cut to {keep} of {n_layer} layers -> {a.dst}")


if __name__ == "__main__":
    main()
