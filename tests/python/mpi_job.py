"""One rank of the MPI tests (run by test_mpi.py under mpiexec): desi_proc's ways of calling
the extraction over a communicator. Rank 0 prints one line per rank, `rank R: ok` or
`rank R: ExceptionType: message`; the test reads them.

    mpi_job.py world LINE                  every rank of COMM_WORLD, one job line
    mpi_job.py timing LINE                 the same with a timing dict: `ok KEY KEY ...`
    mpi_job.py split LINE LINE             comm.Split into groups of 2, camera i to group i
    mpi_job.py coordinator LINE            comm.Create_group of every rank, with a coordinator
    mpi_job.py exposure LINE LINE ...      main_exposure over COMM_WORLD, 2 frame groups
    mpi_job.py one-rank LINE OTHER         COMM_WORLD, rank 2 alone given the line OTHER
    mpi_job.py interrupt DIR LINE ...      main_exposure over COMM_WORLD, one frame group,
                                           each rank's process id written to DIR/rank-R.pid
                                           first (for the test to interrupt one rank)
"""

import os
import sys

from mpi4py import MPI

import conftest  # noqa: F401  (specter stand-in, DESIMODEL)
import desispec.scripts.extract as desispec_extract
import spex.desispec


class ParallelIOCoordinator:
    """gpu_specter's coordinator as desi_proc makes it: what spex reads of it is its
    communicator and its kind (rank 0 reads, rank 1 writes, the others work)."""

    def __init__(self, comm):
        self.comm = comm


def parse(line):
    return desispec_extract.parse(line.split()[1:])


def main():
    mode, lines = sys.argv[1], sys.argv[2:]
    comm = MPI.COMM_WORLD
    rank = comm.rank
    try:
        timing = {}
        if mode == "world":
            spex.desispec.main(parse(lines[0]), comm=comm)
        elif mode == "timing":
            spex.desispec.main(parse(lines[0]), comm=comm, timing=timing)
        elif mode == "split":
            group = rank // 2
            comm_extract = comm.Split(color=group)
            for i in range(group, len(lines), comm.size // 2):
                spex.desispec.main(parse(lines[i]), comm=comm_extract)
            comm_extract.Free()
        elif mode == "coordinator":
            comm_extract = comm.Create_group(comm.group.Incl(list(range(comm.size))))
            coordinator = ParallelIOCoordinator(comm_extract)
            spex.desispec.main(parse(lines[0]), coordinator=coordinator)
        elif mode == "one-rank":
            spex.desispec.main(parse(lines[1] if rank == 2 else lines[0]), comm=comm)
        elif mode == "interrupt":
            pid_dir, lines = lines[0], lines[1:]
            with open(os.path.join(pid_dir, f"rank-{rank}.pid"), "w") as f:
                f.write(str(os.getpid()))
            spex.desispec.main_exposure([parse(l) for l in lines], comm=comm)
        elif mode == "exposure":
            spex.desispec.main_exposure([parse(l) for l in lines], comm=comm, frame_groups=2)
        else:
            raise SystemExit(f"unknown mode {mode}")
        outcome = " ".join(["ok", *timing])
    except (Exception, KeyboardInterrupt) as e:  # desi_proc catches per rank, then meets
        outcome = f"{type(e).__name__}: {e}".replace("\n", " | ")
    outcomes = comm.gather(outcome, root=0)
    if rank == 0:
        print("\n".join(f"rank {r}: {o}" for r, o in enumerate(outcomes)), flush=True)


main()
