// settle console: the one script. It ticks every box of a page's selection
// when "all on this page" is ticked. Everything works without it.
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  var all = document.getElementById("all");
  if (!all) return;
  all.addEventListener("change", function () {
    var boxes = document.querySelectorAll('#messages input[type=checkbox][name=id]');
    for (var i = 0; i < boxes.length; i++) boxes[i].checked = all.checked;
  });
});
