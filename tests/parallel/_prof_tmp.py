def prof(**kw):
    import cProfile, pstats, io, os
    from tests.parallel.family_cases import families_on_split
    pr = cProfile.Profile(); pr.enable()
    r = families_on_split(**kw)
    pr.disable()
    if os.environ["RANK"] == "0":
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); open("/tmp/fam3_rank0.txt", "w").write(s.getvalue())
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60); open("/tmp/fam3_rank0c.txt", "w").write(s.getvalue())
    return r
