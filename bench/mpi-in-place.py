#!/usr/bin/env python3
"""Open MPI's in-place counterpart of the peer benchmark (../shared/peers/mpi_collectives), so
that `shardline-bench collectives --in-place` has a side-by-side reference.

Copies the peer's run.py, common.py and mpi_collectives.c into DIR (default
out/mpi-in-place), rewrites the reduce-scatter and all-gather calls to their MPI_IN_PLACE
forms (and their result checks to where MPI puts the result), and prints the path of the
copied run.py, which takes the peer's usual flags:

    python3 "$(python3 bench/mpi-in-place.py)" --worlds 2 --transports shm --sizes 67108864
"""
import os, shutil, sys

peers = os.environ.get("PEERS", "../shared/peers")
out = sys.argv[1] if len(sys.argv) > 1 else "out/mpi-in-place"
sub = os.path.join(out, "mpi_collectives")
os.makedirs(sub, exist_ok=True)
shutil.copy(os.path.join(peers, "common.py"), out)
shutil.copy(os.path.join(peers, "mpi_collectives", "run.py"), sub)
src = open(os.path.join(peers, "mpi_collectives", "mpi_collectives.c")).read()

edits = [
    # reduce-scatter: input and result in `in` (MPI puts the own block at its start)
    ("MPI_Reduce_scatter_block(in, out, (int)chunk,",
     "MPI_Reduce_scatter_block(MPI_IN_PLACE, in, (int)chunk,"),
    ("for (long i = 0; i < chunk && ok; i++) ok = out[i] ==",
     "for (long i = 0; i < chunk && ok; i++) ok = in[i] =="),
    # all-gather: the own block already lies in its slot of `out`
    ("MPI_Allgather(in, (int)chunk, MPI_FLOAT, out,",
     "MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out,"),
    ("for (long i = 0; i < n; i++) out[i] = -1.f;\n      do_op(op, in, out, n, chunk);",
     "for (long i = 0; i < n; i++) out[i] = -1.f;\n"
     "      fill(out + rank * chunk, chunk, (float)(rank * 1000), 0);\n"
     "      do_op(op, in, out, n, chunk);"),
]
for old, new in edits:
    if src.count(old) != 1:
        sys.exit(f"mpi-in-place: the peer source changed; cannot find: {old!r}")
    src = src.replace(old, new)
open(os.path.join(sub, "mpi_collectives.c"), "w").write(src)
print(os.path.join(sub, "run.py"))
