import json,subprocess,sys
# Every package the library itself pulls in (normal deps, this platform), with its declared rust-version.
meta=json.loads(subprocess.check_output(['cargo','metadata','--format-version','1','--locked','--filter-platform','x86_64-unknown-linux-gnu']))
pk={p['id']:p for p in meta['packages']}
nodes={n['id']:n for n in meta['resolve']['nodes']}
root=[p['id'] for p in meta['packages'] if p['name']=='vmmbuf'][0]
seen=set(); stack=[root]
while stack:
    i=stack.pop()
    if i in seen: continue
    seen.add(i)
    for d in nodes[i]['deps']:
        if any(k['kind'] is None for k in d['dep_kinds']): stack.append(d['pkg'])
rows=sorted(((pk[i].get('rust_version') or '-'),pk[i]['name'],pk[i]['version']) for i in seen if i!=root)
key=lambda v: tuple(int(x) for x in v.split('.')) if v!='-' else (0,)
for r in sorted(rows,key=lambda r:key(r[0]),reverse=True)[:8]: print(*r)
