"""Building, caching and loading compiled artifacts: the compile driver, the kernel registry, the
disk cache, the runtime-only loader, cluster-fit queries and SASS reading."""
