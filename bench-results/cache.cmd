script/cache-bench.sh
