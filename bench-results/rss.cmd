script/rss-bench.sh 
