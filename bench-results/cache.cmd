script/cache-bench.sh 
