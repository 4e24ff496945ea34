"""desi_proc (desispec.scripts.proc.main) on the simulated night of night.py, run by
test_desi_proc.py in a process of its own, with desi_proc's options as arguments.

    desi_proc_job.py plain ARGS...   desi_proc without MPI: it spawns `desi_extract_spectra`
                                     from PATH for each camera
    desi_proc_job.py mpi ARGS...     desi_proc over MPI.COMM_WORLD (under mpiexec), with
                                     desispec.scripts.extract's main_gpu_specter and main_mpi
                                     replaced by spex.desispec.main, as the README shows

Exits with desi_proc's status. In mpi mode each rank prints `rank R: spex calls N`.
"""

import sys

import conftest  # noqa: F401  (specter stand-in, DESIMODEL)
import desispec.scripts.extract
import desispec.scripts.proc


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "plain":
        return desispec.scripts.proc.main(args)
    if mode != "mpi":
        raise SystemExit(f"unknown mode {mode}")
    from mpi4py import MPI

    import spex.desispec

    calls = []

    def spex_main(extract_args, comm=None, timing=None, coordinator=None):
        calls.append(extract_args.output)
        return spex.desispec.main(extract_args, comm=comm, timing=timing, coordinator=coordinator)

    desispec.scripts.extract.main_gpu_specter = spex_main
    desispec.scripts.extract.main_mpi = spex_main
    comm = MPI.COMM_WORLD
    status = desispec.scripts.proc.main(args, comm=comm)
    print(f"rank {comm.rank}: spex calls {len(calls)}", flush=True)
    return status


sys.exit(main())
