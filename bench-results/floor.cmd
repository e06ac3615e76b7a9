script/fs-bench.sh --floor --out /work/main/bench-results/floor.tsv --only 'create|stat|rm|mkdir|find|git' keel ext4 tmpfs 
