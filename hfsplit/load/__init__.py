"""Where planning meets running: the single-process `from_pretrained` (`materialize`), the distributed split
(`launch`: plan on rank 0, build this rank's SplitModel) and the probes that time real blocks on the launched
devices (`probes`)."""
