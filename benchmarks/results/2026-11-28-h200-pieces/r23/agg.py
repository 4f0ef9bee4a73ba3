import collections,sys
stacks=[];cur=[]
for line in open(sys.argv[1],errors='replace'):
    if not line.strip():
        if cur: stacks.append(cur); cur=[]
        continue
    if not line.startswith((' ','\t')):
        cur=[line.strip()]
    else:
        parts=line.strip().split(None,1)
        cur.append(parts[1] if len(parts)>1 else '?')
if cur: stacks.append(cur)
post=[s for s in stacks if any('tcpx_writev_async' in f or 'tcpx_readv_async' in f for f in s[1:])]
print('samples',len(stacks),'in posting calls',len(post))
leaf=collections.Counter(s[1].split('+0x')[0] for s in post)
for k,v in leaf.most_common(30): print(v,k[:150])
print('--- inclusive')
inc=collections.Counter()
for s in post:
    seen=set()
    for f in s[1:]:
        f=f.split('+0x')[0]
        if f not in seen: inc[f]+=1; seen.add(f)
for k,v in inc.most_common(150): print(v,k[:160])
