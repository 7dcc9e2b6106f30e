-- merge, part 3 of 3 (after merge.lua and merge_paths.lua; one chunk): the
-- writes, key by key, the relay queue and the reply.
local o = 0  -- offset of key i's cells in cells
for i = 1, n do
  local m = counts[i]
  local spec, last = specs[i], o + 4 * m
  if spec and m == 1 and merge_one(i, o, spec) then
    -- done
  elseif spec then
    local key = tag .. ':' .. keys[i]
    local N, M, F, ttl, c, rises = spec[2], spec[3], spec[4], spec[5], spec[6], stamp and spec[9]
    local k, maxb = 0, nil
    for j = o + 1, last, 4 do
      local b, r = cells[j], cells[j + 1]
      if r < 0 then
        -- an own-slot claim skipped in repair mode
      elseif b > c + F then
        if b > c + F + spec[10] or not park(keys[i], b, slots[r + 1], cells[j + 2], cells[j + 3], (b - F) * spec[1]) then
          fut = fut + 1
        end
      elseif b < c - N then
        old = old + 1
      else
        local f = idx[r + 1] * M + b % M
        local p = nil
        if m > 1 then p = pos[f] end
        if p then  -- the same cell twice: keep the larger value and floor
          if cells[j + 2] > cv[p] then cv[p] = cells[j + 2] end
          if cells[j + 3] > cw[p] then cw[p] = cells[j + 3] end
        else
          k = k + 1
          cb[k], cf[k], cv[k], cw[k], sv[k], sw[k] = b, f, cells[j + 2], cells[j + 3], 0, 0
          if m > 1 then pos[f] = k end
          if not maxb or b > maxb then maxb = b end
        end
      end
    end
    if m > 1 then for q = 1, k do pos[cf[q]] = nil end end
    if k > 0 then
      local h, e = nil, nil  -- the key's head and expiry mark (its decimal string)
      local whole = not dense and spec[8]
      local stale = nil  -- fields of the ring positions a moving head passes over
      -- the low mark to write (see merge_one): at most the oldest bucket of a field kept;
      -- ls0 the stored one
      local low, ls0 = nil, nil
      if whole then
        low = c - F
        local flat = call('HGETALL', key)
        local nf = #flat
        if nf > 64 then dense = true end
        if nf > 0 then
          local hs = nil
          if flat[1] == 'h' then hs = flat[2] else
            for x = 3, nf, 2 do if flat[x] == 'h' then hs = flat[x + 1] break end end
          end
          -- Most heads are the cell's bucket or the one before: compare strings (tonumber is dear).
          if hs == nil then h = nil
          elseif hs == fnames[maxb] then h = maxb
          elseif hs == fnames[maxb - 1] then h = maxb - 1
          else h = strnum[hs] or nil end
        end
        if h then
          local moves, gone = maxb > h and maxb - h < M, nil
          if moves then gone = passed(spec, h, maxb - h) end
          local n1, n2 = nil, nil
          if k == 1 then
            if cb[1] <= h and cb[1] > h - M then n1, n2 = fnames[cf[1]], fnames[-cf[1] - 1] end
          else
            for q = 1, k do
              local b = cb[q]
              if b <= h and b > h - M then
                want[fnames[cf[q]]] = q
                want[fnames[-cf[q] - 1]] = -q
              end
            end
          end
          for x = 1, nf, 2 do
            local name = flat[x]
            local drop = false
            if gone then
              drop = gone[name]
            elseif moves then
              local f = tonumber(name)
              if f then
                if f < 0 then f = -f - 1 end
                drop = (f % M - h - 1) % M < maxb - h
              end
            end
            if drop then
              stale = stale or {}
              stale[#stale + 1] = name
            elseif name == 'e' then
              e = flat[x + 1]
            elseif name == 'l' then
              ls0 = flat[x + 1]
            else
              if k == 1 then
                if name == n1 then sv[1] = nums[flat[x + 1]]
                elseif name == n2 then sw[1] = nums[flat[x + 1]] end
              else
                local q = want[name]
                if q then
                  if q > 0 then sv[q] = nums[flat[x + 1]] else sw[-q] = nums[flat[x + 1]] end
                end
              end
            end
          end
          if k > 1 then
            for q = 1, k do
              want[fnames[cf[q]]] = nil
              want[fnames[-cf[q] - 1]] = nil
            end
          end
          low = oldest_kept(flat, h, M, low, stale, maxb > h and maxb or h)
        elseif nf > 0 then
          low = nil  -- fields but no head: leave the key without a low mark
        end
      else
        local fields = {'h'}
        for q = 1, k do
          fields[2 * q] = fnames[cf[q]]
          fields[2 * q + 1] = fnames[-cf[q] - 1]
        end
        fields[2 * k + 2] = 'e'
        fields[2 * k + 3] = 'l'
        local got = hmget_all(key, fields)
        h, e, ls0 = tonumber(got[1]), got[2 * k + 2], got[2 * k + 3]
        if h then
          for q = 1, k do
            local b = cb[q]
            if b <= h and b > h - M then
              sv[q], sw[q] = tonumber(got[2 * q]) or 0, tonumber(got[2 * q + 1]) or 0
            end
          end
        end
      end
      local newh = h
      if not h or maxb > h then newh = maxb end
      if h and newh > h then
        if newh - h >= M then
          call('DEL', key)
          h, e, ls0, low = nil, nil, nil, c - F
          for q = 1, k do sv[q], sw[q] = 0, 0 end
        elseif whole then
          if stale then chunked('HDEL', key, stale, 1000) end
        else
          clear(key, h, newh, M)
        end
      end
      nw = 0
      local mark = nil
      if newh ~= h then
        write[1], write[2], nw = 'h', fnames[newh], 2
        mark = mark_for(e, ttl)
        if mark then write[3], write[4], nw = 'e', fmt(mark), 4 end
      end
      local lowest = nil
      for q = 1, k do
        local b = cb[q]
        if b <= newh - M then
          old = old + 1
        else
          local v, w, v0, w0 = cv[q], cw[q], sv[q], sw[q]
          if v > v0 or w > w0 then
            if v < v0 then v = v0 end
            if w < w0 then w = w0 end
            inc = inc + 1
            if not lowest or b < lowest then lowest = b end
            local f = cf[q]
            if rises and v > v0 and f >= M then  -- a peer slot's count may have risen (floors applied)
              local add = counted(v, w) - counted(v0, w0)
              if add > 0 then
                local x = (f - f % M) / M
                if nr == 0 then nr, x1, u1 = 1, x, add  -- the usual case: one peer slot
                elseif x == x1 then u1 = u1 + add
                else
                  local had = rose[x]
                  if had then rose[x] = had + add else nr = nr + 1 rslots[nr] = x rose[x] = add end
                end
              end
            end
            if v > 0 then write[nw + 1], write[nw + 2], nw = fnames[f], fnames[v], nw + 2 end
            if w > 0 then write[nw + 1], write[nw + 2], nw = fnames[-f - 1], fnames[w], nw + 2 end
          end
        end
      end
      if nr > 0 then
        write[nw + 1], write[nw + 2], nw = pnames[x1], risen[u1], nw + 2
        for y = 2, nr do
          local x = rslots[y]
          write[nw + 1], write[nw + 2], nw = pnames[x], risen[rose[x]], nw + 2
          rose[x] = nil
        end
        nr = 0
      end
      if lowest then
        if low then
          if lowest < low then low = lowest end
        elseif ls0 and h then  -- read by name: only ever lower the stored mark
          local l = tonumber(ls0)
          if l and lowest < l then low = lowest end
        end
      end
      if low and (h or lowest) and fnames[low] ~= ls0 then write[nw + 1], write[nw + 2], nw = 'l', fnames[low], nw + 2 end
      -- A key that does not exist and gains nothing is not created.
      if h or lowest then
        write_fields(key, nw)
        if mark then arm_expiry(key, mark) end
      end
      if lowest and relaying then
        queued[#queued + 1] = key
        queued[#queued + 1] = fmt(-lowest - 1)
        nq = nq + 1
      end
    end
  end
  o = last
end
if #queued > 0 then
  for r = 1, #relay do enqueue(tag .. '#o:' .. relay[r], tag .. '#t:' .. relay[r], queued, raw) end
end
if parked > 0 then
  local keep = math.floor((park_last - now) / 1000) + 60000  -- ms: the last due time, and a minute to release it
  for _, name in ipairs({pk, pz}) do
    if call('PTTL', name) < keep then call('PEXPIRE', name, keep) end
  end
end
-- (then, only if parking keys of another type were deleted, the list of their names)
return {1, total, inc, old, fut, unknown, nq * #relay, own_ahead, parked, park_first or -1, park_junk}
