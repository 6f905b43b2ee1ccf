"""A process's cgroup files as the kernel writes them, in a folder of their
own: ``cgroup`` (``ID:CONTROLLERS:PATH`` lines) and ``mountinfo`` (one line
per mount of a cgroup hierarchy), for the readers of cgroup limits
(:func:`hpcjobs.runtime.cgroup_hierarchies`)."""


def fake_proc(folder, cgroup_lines, mounts):
    """``folder``/proc holding ``cgroup_lines`` and, for each (root, mount
    point, fstype, superoptions) of ``mounts``, a mountinfo line; its path."""
    proc = folder / "proc"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("\n".join(cgroup_lines) + "\n")
    (proc / "mountinfo").write_text("\n".join(f"{i} 1 0:{i} {root} {point} rw - {fs} cgroup rw,{opts}"
                                              for i, (root, point, fs, opts) in enumerate(mounts, 30)) + "\n")
    return str(proc)
