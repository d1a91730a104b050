local M = {}

function M.count(text)
  local counts = {}
  for word in string.gmatch(text, "%S+") do
    counts[word] = (counts[word] or 0) + 1
  end
  return counts
end

return M
