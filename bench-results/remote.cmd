script/remote-bench.sh 
