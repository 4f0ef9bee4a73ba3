cd /work/main
for i in 1 2 3 4 5 6; do
  for b in head new; do
    [ $((i % 2)) = 0 ] && { [ $b = head ] && b=new || b=head; }
    r=$(PYTHONPATH=$SITE_DIR_$b timeout 120 .venv/bin/python -m tcpx_p2p.bench pair --memory host --op write --sizes 256M 2>&1 | awk '$1=="write" && $2=="256M" {print $4}')
    k=$(PYTHONPATH=$SITE_DIR_$b timeout 120 .venv/bin/python -m tcpx_p2p.bench pair --memory host --inflight 1 --op write --sizes 4K,64K --rounds 1 2>&1 | awk '$1=="write" && ($2=="4K" || $2=="64K") {printf "%s p50 %s ", $2, $5}')
    echo "$i $b pipelined256M $r GB/s; $k" >> /tmp/ab3.log
  done
done
echo done >> /tmp/ab3.log
